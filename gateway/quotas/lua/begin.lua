-- kvgate request admission, taken right after authentication (docs/gateway.md, "Refuse before
-- working"): one request against RPM and a concurrency lease, admitted together or not at all; the
-- request's tokens follow once they are counted (tokens.lua). A refusal changes nothing.
-- Window algorithm and keys: as reserve.lua (sliding-window log; the six {tenant} keys).
-- ARGV: lease_id, rpm, max_concurrent (-1 = unlimited), window_ms, lease_ttl_ms
-- Returns {admitted 1|0, refused "rpm,concurrency" subset, retry_after_ms,
--          remaining_requests (-1 = unlimited), -1, 0}; a refusal's has two more: the requests the
--          window holds (-1 = unlimited; above rpm where a reload lowered it, for its 429) and -1;
--          {0, "cancelled", 0, -1, -1, 0} after cancel.lua
local id = ARGV[1]
-- cancel.lua undid this call already (it reached Redis late, the gateway had given up on it): no-op
if redis.call('ZSCORE', KEYS[6], id) then return {0, 'cancelled', 0, -1, -1, 0} end
local rpm = tonumber(ARGV[2])
local maxc = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window
local c, n = string.format('%d', cutoff), string.format('%d', now)

-- reads first, the admission's own entries the first write, trims after: under maxmemory with
-- noeviction Redis refuses an adding command only while the script has written nothing (removals
-- included), so an admission is refused whole and a refusal writes no more than its trims
local count, inflight = 0, 0
if rpm >= 0 then count = redis.call('ZCOUNT', KEYS[1], '(' .. c, '+inf') end
if maxc >= 0 then inflight = redis.call('ZCOUNT', KEYS[5], '(' .. n, '+inf') end

local function trim()
  if rpm >= 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', c) end
  if maxc >= 0 then redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', n) end
end

local function live(key, bound)
  local s = redis.call('ZSCORE', key, id)
  return s and tonumber(s) > bound
end

-- this very call ran already (its reply was lost and the store sent it again): admitted again,
-- its remaining requests as of now (those admitted since count: never more than its first answer
-- said), never count the request twice nor refuse it for its own entry
if (rpm >= 0 and live(KEYS[1], cutoff)) or (maxc >= 0 and live(KEYS[5], now)) then
  trim()
  local rr = -1
  if rpm >= 0 then rr = math.max(0, rpm - count) end
  return {1, '', 0, rr, -1, 0}
end

local refused = {}
local retry = 0
if rpm >= 0 and count + 1 > rpm then table.insert(refused, 'rpm') end
if maxc >= 0 and inflight + 1 > maxc then table.insert(refused, 'concurrency') end

local rr = -1
if rpm >= 0 then rr = math.max(0, rpm - count) end
if #refused > 0 then
  trim()
  if rpm >= 0 and count + 1 > rpm then
    if rpm == 0 then
      retry = window
    else
      local e = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
      retry = tonumber(e[2]) + window - now
    end
  end
  if maxc >= 0 and inflight + 1 > maxc then retry = math.max(retry, 1000) end
  return {0, table.concat(refused, ','), math.max(1, retry), rr, -1, 0, rpm >= 0 and count or -1, -1}
end
if rpm >= 0 then redis.call('ZADD', KEYS[1], now, id) end
if maxc >= 0 then redis.call('ZADD', KEYS[5], now + ttl, id) end
trim()
if rpm >= 0 then
  redis.call('PEXPIRE', KEYS[1], window + 1000)
  rr = rpm - count - 1
end
if maxc >= 0 then redis.call('PEXPIRE', KEYS[5], ttl + 1000) end
return {1, '', 0, rr, -1, 0}
