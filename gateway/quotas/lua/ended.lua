-- The lease ids a tenant's scripts must not count again, shared by cancel.lua and settle.lua
-- (RedisQuotaStore loads it in front of each: a script runs alone, without imports).
-- KEYS[6] the ended set  ZSET  lease id -> forgotten after (ms), on the tenant's slot ({tenant}):
--   cancel.lua's tombstones (begin.lua, reserve.lua and tokens.lua run after them are no-ops) and
--   settle.lua's marks of an overage charged (a settle sent again charges nothing more).
-- remember_ended(ids, now, keep): ids remembered until now + keep (ms); entries past their time
-- dropped (amortized: each once); the key lives as long as its newest entry. Call it after the
-- script's first write: under maxmemory with noeviction a script's first write decides.
local function remember_ended(ids, now, keep)
  for i = 1, #ids do redis.call('ZADD', KEYS[6], now + keep, ids[i]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
  if redis.call('PTTL', KEYS[6]) < keep + 1000 then redis.call('PEXPIRE', KEYS[6], keep + 1000) end
end
