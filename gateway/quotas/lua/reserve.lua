-- kvgate quota reservation (DESIGN.md step 6): one request (RPM), its tokens (TPM) and a
-- concurrency lease, admitted together or not at all. A refusal changes nothing.
--
-- Window algorithm: sliding-window log. An admission is logged at the server's own clock (TIME,
-- so replicas' clocks do not matter) and counts while now - admitted_at < window; the log is
-- trimmed lazily on every call. At most `limit` requests / tokens are admitted in ANY window.
--
-- KEYS[1] rpm log      ZSET  lease id -> admission time (ms)
-- KEYS[2] tpm log      ZSET  lease id -> admission time (ms)
-- KEYS[3] tpm debits   HASH  lease id -> tokens debited
-- KEYS[4] tpm sum      STRING the sum of KEYS[3]
-- KEYS[5] leases       ZSET  lease id -> lease expiry (ms)
-- KEYS[6] ended        ZSET  lease id -> forgotten after (ms): cancel.lua's tombstones, settle.lua's marks (ended.lua)
-- All six carry the {tenant} hash tag, so the script runs on Redis Cluster.
-- ARGV: lease_id, rpm, tpm, max_concurrent (-1 = unlimited), tokens, window_ms, lease_ttl_ms
-- Returns {admitted 1|0, refused "rpm,tpm,concurrency" subset, retry_after_ms,
--          remaining_requests (-1 = unlimited), remaining_tokens (-1 = unlimited), too_large 1|0}; a
--          refusal's has two more: the requests and the tokens the window holds (-1 = unlimited; above
--          the limit where a reload lowered it, for its 429);
-- {0, "cancelled", 0, -1, -1, 0} when cancel.lua undid this call before it ran (a no-op).
local id = ARGV[1]
-- cancel.lua undid this call already (it reached Redis late, the gateway had given up on it): no-op
if redis.call('ZSCORE', KEYS[6], id) then return {0, 'cancelled', 0, -1, -1, 0} end
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local maxc = tonumber(ARGV[4])
local tokens = tonumber(ARGV[5])
local window = tonumber(ARGV[6])
local ttl = tonumber(ARGV[7])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window
local BATCH = 256

local c, n = string.format('%d', cutoff), string.format('%d', now)

-- reads first, the admission's own entries the first write, trims after: under maxmemory with
-- noeviction Redis refuses an adding command only while the script has written nothing (removals
-- included), so an admission is refused whole and a refusal writes no more than its trims
local count, used, inflight = 0, 0, 0
local win
if rpm >= 0 then count = redis.call('ZCOUNT', KEYS[1], '(' .. c, '+inf') end
if tpm >= 0 then
  win = tpm_window(cutoff, BATCH)
  used = win.used
end
if maxc >= 0 then inflight = redis.call('ZCOUNT', KEYS[5], '(' .. n, '+inf') end

local function trim(keep)
  -- the TPM window's first: a rebuilt sum is an adding write (tpm_window.lua)
  if tpm >= 0 then tpm_trim(win, window, keep) end
  if rpm >= 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', c) end
  if maxc >= 0 then redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', n) end
end

local function live(key, bound)
  local s = redis.call('ZSCORE', key, id)
  return s and tonumber(s) > bound
end

-- this very call ran already (its reply was lost and the store sent it again): admitted again,
-- its remaining requests as of now (those admitted since count: never more than its first answer
-- said), never count the request twice nor refuse it for its own entries
if (rpm >= 0 and live(KEYS[1], cutoff)) or (tpm >= 0 and tpm_holds(win, id)) or (maxc >= 0 and live(KEYS[5], now)) then
  trim()
  local rr, rt = -1, -1
  if rpm >= 0 then rr = math.max(0, rpm - count) end
  if tpm >= 0 then rt = tpm - used end
  return {1, '', 0, rr, rt, 0}
end

local refused = {}
local retry = 0
local too_large = 0
if (rpm >= 0 and count + 1 > rpm) or (tpm >= 0 and used + tokens > tpm) or (maxc >= 0 and inflight + 1 > maxc) then
  trim()
end
if rpm >= 0 and count + 1 > rpm then
  table.insert(refused, 'rpm')
  if rpm == 0 then
    retry = math.max(retry, window)
  else
    -- the (count - rpm + 1)-th oldest entry leaving the window makes room for one more
    local e = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
    retry = math.max(retry, tonumber(e[2]) + window - now)
  end
end
if tpm >= 0 and used + tokens > tpm then
  table.insert(refused, 'tpm')
  if tokens > tpm then
    too_large = 1
    retry = math.max(retry, window)
  else
    local at = tpm_freed_at(used + tokens - tpm, now, BATCH)
    retry = math.max(retry, at + window - now)
  end
end
if maxc >= 0 and inflight + 1 > maxc then
  table.insert(refused, 'concurrency')
  -- a lease ends when its request does, which no clock here can tell: ask to retry in a second
  retry = math.max(retry, 1000)
end

if #refused > 0 then
  local rr, rt = -1, -1
  if rpm >= 0 then rr = math.max(0, rpm - count) end
  if tpm >= 0 then rt = math.max(0, tpm - used) end
  local ur, ut = -1, -1
  if rpm >= 0 then ur = count end
  if tpm >= 0 then ut = used end
  return {0, table.concat(refused, ','), math.max(1, retry), rr, rt, too_large, ur, ut}
end

if rpm >= 0 then redis.call('ZADD', KEYS[1], now, id) end
if tpm >= 0 then redis.call('ZADD', KEYS[2], now, id) end
if maxc >= 0 then redis.call('ZADD', KEYS[5], now + ttl, id) end
trim(id)
local rr, rt = -1, -1
if rpm >= 0 then
  redis.call('PEXPIRE', KEYS[1], window + 1000)
  rr = rpm - count - 1
end
if tpm >= 0 then
  redis.call('HSET', KEYS[3], id, tokens)
  redis.call('INCRBY', KEYS[4], tokens)
  for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
  rt = tpm - used - tokens
end
if maxc >= 0 then redis.call('PEXPIRE', KEYS[5], ttl + 1000) end
return {1, '', 0, rr, rt, 0}
