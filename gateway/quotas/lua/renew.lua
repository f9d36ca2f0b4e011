-- kvgate lease renewal: push the expiry of this replica's live leases to now + ttl. Leases
-- that already expired (and were purged) stay gone: their slot may have been handed out again.
-- KEYS[1] leases ZSET (lease id -> expiry ms). ARGV: ttl_ms, lease ids...
-- Returns how many leases were renewed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local exp = now + tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if s and tonumber(s) > now then
    redis.call('ZADD', KEYS[1], exp, ARGV[i])
    n = n + 1
  end
end
if n > 0 then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) + 1000) end
return n
