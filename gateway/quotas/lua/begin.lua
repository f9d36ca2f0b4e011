-- kvgate request admission, taken right after authentication (docs/gateway.md, "Refuse before
-- working"): one request against RPM and a concurrency lease, admitted together or not at all; the
-- request's tokens follow once they are counted (tokens.lua). A refusal changes nothing.
-- Window algorithm and keys: as reserve.lua (sliding-window log; the six {tenant} keys).
-- ARGV: lease_id, rpm, max_concurrent (-1 = unlimited), window_ms, lease_ttl_ms
-- Returns {admitted 1|0, refused "rpm,concurrency" subset, retry_after_ms,
--          remaining_requests (-1 = unlimited), -1, 0}; {0, "cancelled", 0, -1, -1, 0} after cancel.lua
local id = ARGV[1]
-- cancel.lua undid this call already (it reached Redis late, the gateway had given up on it): no-op
if redis.call('ZSCORE', KEYS[6], id) then return {0, 'cancelled', 0, -1, -1, 0} end
local rpm = tonumber(ARGV[2])
local maxc = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local count, inflight = 0, 0
if rpm >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  count = redis.call('ZCARD', KEYS[1])
end
if maxc >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[5])
end

-- this very call ran already (its reply was lost and the store sent it again): answer as it did
-- then, never count the request twice nor refuse it for its own entry
if (rpm >= 0 and redis.call('ZSCORE', KEYS[1], id)) or (maxc >= 0 and redis.call('ZSCORE', KEYS[5], id)) then
  local rr = -1
  if rpm >= 0 then rr = math.max(0, rpm - count) end
  return {1, '', 0, rr, -1, 0}
end

local refused = {}
local retry = 0
if rpm >= 0 and count + 1 > rpm then
  table.insert(refused, 'rpm')
  if rpm == 0 then
    retry = window
  else
    local e = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
    retry = tonumber(e[2]) + window - now
  end
end
if maxc >= 0 and inflight + 1 > maxc then
  table.insert(refused, 'concurrency')
  retry = math.max(retry, 1000)
end

local rr = -1
if rpm >= 0 then rr = math.max(0, rpm - count) end
if #refused > 0 then
  return {0, table.concat(refused, ','), math.max(1, retry), rr, -1, 0}
end
if rpm >= 0 then
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('PEXPIRE', KEYS[1], window + 1000)
  rr = rpm - count - 1
end
if maxc >= 0 then
  redis.call('ZADD', KEYS[5], now + ttl, id)
  redis.call('PEXPIRE', KEYS[5], ttl + 1000)
end
return {1, '', 0, rr, -1, 0}
