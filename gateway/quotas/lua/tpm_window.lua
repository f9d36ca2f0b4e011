-- The TPM window, shared by reserve.lua and tokens.lua (RedisQuotaStore loads it in front of each:
-- a script runs alone, without imports). Keys as reserve.lua's: KEYS[2] the tpm log, KEYS[3] the
-- debits, KEYS[4] their sum.
-- tpm_used(cutoff, window, batch): trims the debits logged at or before cutoff (batch at a time)
-- and returns the tokens the window holds.
local function tpm_used(cutoff, window, batch)
  while true do
    local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff, 'LIMIT', 0, batch)
    if #old == 0 then break end
    local debits = redis.call('HMGET', KEYS[3], unpack(old))
    local freed = 0
    for i = 1, #debits do freed = freed + (tonumber(debits[i]) or 0) end
    redis.call('ZREM', KEYS[2], unpack(old))
    redis.call('HDEL', KEYS[3], unpack(old))
    if freed ~= 0 then redis.call('DECRBY', KEYS[4], freed) end
    if #old < batch then break end
  end
  local sum = redis.call('GET', KEYS[4])
  local used = tonumber(sum or '0')
  -- the sum, the log and the debits agree unless a key was evicted (a maxmemory policy) or lost
  -- alone: then the sum is rebuilt from the logged debits, never left negative nor holding tokens
  -- no debit accounts for (each admission's PEXPIRE would keep such a sum for good)
  local n = redis.call('HLEN', KEYS[3])
  if (not sum and n > 0) or used < 0 or (n == 0 and used ~= 0) or n ~= redis.call('ZCARD', KEYS[2]) then
    used = 0
    local kv = redis.call('HGETALL', KEYS[3])
    for i = 1, #kv, 2 do
      if redis.call('ZSCORE', KEYS[2], kv[i]) then used = used + tonumber(kv[i + 1])
      else redis.call('HDEL', KEYS[3], kv[i]) end
    end
    local ids = redis.call('ZRANGE', KEYS[2], 0, -1)
    for i = 1, #ids do
      if redis.call('HEXISTS', KEYS[3], ids[i]) == 0 then redis.call('ZREM', KEYS[2], ids[i]) end
    end
    redis.call('SET', KEYS[4], used)
    for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
  end
  return used
end

