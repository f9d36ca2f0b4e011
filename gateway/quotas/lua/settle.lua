-- kvgate quota settlement: release the request's concurrency lease and correct its TPM debit
-- from the reservation (prompt + n x max_tokens) to the tokens actually used.
-- KEYS: as reserve.lua (rpm log, tpm log, tpm debits, tpm sum, leases), KEYS[6] the ended set
-- (ended.lua).
-- ARGV: lease_id, used_tokens, reserved_tokens, window_ms, track_tpm 1|0, keep_ms
-- If the debit already left the window (a request longer than the window), the window has
-- already carried the reservation; only usage above the reservation is debited, now.
-- Run again for the same lease (its first reply was lost, so the gateway sent it again, maybe
-- more than a window later: the first run's debit, or its overage debit, has left the log) it
-- charges nothing more: a settle that charged usage above the reservation leaves the lease id in
-- the ended set for keep_ms (only those: the others, run again, charge nothing either way).
-- Returns the change to the tpm sum (tokens; negative = refunded).
local id = ARGV[1]
local used = tonumber(ARGV[2])
local reserved = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
local keep = tonumber(ARGV[6])
redis.call('ZREM', KEYS[5], id)
if ARGV[5] ~= '1' then return 0 end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local at = redis.call('ZSCORE', KEYS[2], id)
local cur = redis.call('HGET', KEYS[3], id)
if at and cur and tonumber(at) > now - window then
  local delta = used - tonumber(cur)
  if delta ~= 0 then
    redis.call('HSET', KEYS[3], id, used)
    -- a sum that is gone (evicted) stays gone: tokens.lua rebuilds it from the debits
    if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('INCRBY', KEYS[4], delta) end
  end
  if used > reserved then remember_ended({id}, now, keep) end
  return delta
end
-- this settle ran already (its reply was lost): its overage is charged, or was and left the window
local xid = id .. ':x'
if redis.call('ZSCORE', KEYS[6], id) or redis.call('HEXISTS', KEYS[3], xid) == 1 then return 0 end
if used > reserved then
  local extra = used - reserved
  local alone = redis.call('HLEN', KEYS[3]) == 0  -- no debit left: the sum holds nothing else
  redis.call('ZADD', KEYS[2], now, xid)
  redis.call('HSET', KEYS[3], xid, extra)
  if alone then
    redis.call('SET', KEYS[4], extra)
  elseif redis.call('EXISTS', KEYS[4]) == 1 then
    redis.call('INCRBY', KEYS[4], extra)
  end
  for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
  remember_ended({id}, now, keep)
  return extra
end
return 0
