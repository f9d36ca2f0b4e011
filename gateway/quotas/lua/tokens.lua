-- kvgate token reservation for a request begin.lua admitted, once its tokens are counted: the
-- request's KV demand against TPM, or nothing. A refusal changes nothing (the request's RPM entry
-- stays spent; its lease is released by settle.lua).
-- Window algorithm and keys: as reserve.lua (sliding-window log; the six {tenant} keys).
-- ARGV: lease_id, tpm, tokens, window_ms[, begun_key]
-- begun_key (optional, "1" or "5"): the index of the key where begin.lua left lease_id (the rpm
-- log, or the leases without an RPM limit); when it does not hold lease_id, begin.lua refused this
-- request and nothing is debited: {0, "begin", 0, -1, -1, 0}. For begin.lua and this script sent in
-- one round trip, one behind the other (RedisQuotaStore.begin_tokens).
-- Returns {admitted 1|0, "tpm" or "", retry_after_ms, -1, remaining_tokens, too_large 1|0}; a TPM
-- refusal's has two more: -1 and the tokens the window holds (above tpm where a reload lowered it);
-- {0, "cancelled", 0, -1, -1, 0} when cancel.lua undid this call before it ran (a no-op).
local id = ARGV[1]
local tpm = tonumber(ARGV[2])
local tokens = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
-- cancel.lua undid this call already (it reached Redis late, the gateway had given up on it): no-op
if redis.call('ZSCORE', KEYS[6], id) then return {0, 'cancelled', 0, -1, -1, 0} end
if ARGV[5] and not redis.call('ZSCORE', KEYS[tonumber(ARGV[5])], id) then
  return {0, 'begin', 0, -1, -1, 0}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window
local BATCH = 256

local win = tpm_window(cutoff, BATCH)
local used = win.used
-- this very call ran already (its reply was lost and the store sent it again): debit once
if tpm_holds(win, id) then
  tpm_trim(win, window)
  return {1, '', 0, -1, tpm - used, 0}
end

if used + tokens > tpm then
  tpm_trim(win, window)
  if tokens > tpm then return {0, 'tpm', window, -1, math.max(0, tpm - used), 1, -1, used} end
  local at = tpm_freed_at(used + tokens - tpm, now, BATCH)
  return {0, 'tpm', math.max(1, at + window - now), -1, math.max(0, tpm - used), 0, -1, used}
end

-- the admission's own entry is the first write (tpm_window.lua): under maxmemory with noeviction
-- Redis refuses it and the script writes nothing
redis.call('ZADD', KEYS[2], now, id)
tpm_trim(win, window, id)
redis.call('HSET', KEYS[3], id, tokens)
redis.call('INCRBY', KEYS[4], tokens)
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
return {1, '', 0, -1, tpm - used - tokens, 0}
