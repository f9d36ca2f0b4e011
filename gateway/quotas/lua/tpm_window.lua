-- The TPM window, shared by reserve.lua and tokens.lua (RedisQuotaStore loads it in front of each:
-- a script runs alone, without imports). Keys as reserve.lua's: KEYS[2] the tpm log, KEYS[3] the
-- debits, KEYS[4] their sum.
-- Reads first, writes after: under maxmemory with noeviction Redis refuses an adding command only
-- while the script has written nothing, removals included, so a script's first write must be the
-- admission's own (or the rebuilt sum's).
-- tpm_window(cutoff, batch): reads only. Returns the window w: w.used (the tokens it holds once
-- the debits logged at or before cutoff are dropped), and what tpm_trim(w, ...) then writes.
-- tpm_holds(w, id): whether id's debit is in the window (it stays after tpm_trim).
-- tpm_freed_at(need, now, batch): when the window's oldest debits free ``need`` tokens (ms, the
-- server's clock): the admission time of the debit that frees the last of them, ``now`` when the
-- whole log frees less. It walks at most TPM_WALK_MAX of the oldest debits (past them the answer is
-- the last walked debit's, a lower bound): one refused call costs Redis a bounded time however many
-- small debits the tenant holds. Call it after tpm_trim, so the walk starts inside the window.
-- tpm_trim(w, window, keep): drops the expired debits (the log's, the hash's, the sum's) and, when
-- the keys disagreed (a key evicted or lost alone), sets the sum rebuilt from the logged debits
-- first (never left negative nor holding tokens no debit accounts for: each admission's PEXPIRE
-- would keep such a sum for good), dropping debits without a log entry and entries without a
-- debit but keep (the id just logged again).
local function tpm_window(cutoff, batch)
  local w = {cutoff = cutoff, c = string.format('%d', cutoff), expired = {}, freed = 0}
  local gone = redis.call('ZCOUNT', KEYS[2], '-inf', w.c)
  local fields = 0
  for start = 0, gone - 1, batch do
    local old = redis.call('ZRANGE', KEYS[2], start, math.min(start + batch, gone) - 1)
    local debits = redis.call('HMGET', KEYS[3], unpack(old))
    for i = 1, #old do
      w.expired[#w.expired + 1] = old[i]
      if debits[i] then
        fields = fields + 1
        w.freed = w.freed + (tonumber(debits[i]) or 0)
      end
    end
  end
  local sum = redis.call('GET', KEYS[4])
  local used = tonumber(sum or '0') - w.freed
  local n = redis.call('HLEN', KEYS[3]) - fields
  local has_sum = sum or w.freed ~= 0
  if (not has_sum and n > 0) or used < 0 or (n == 0 and used ~= 0) or n ~= redis.call('ZCARD', KEYS[2]) - gone then
    used = 0
    w.rebuild = {debits = {}, log = {}}
    local kv = redis.call('HGETALL', KEYS[3])
    for i = 1, #kv, 2 do
      local s = redis.call('ZSCORE', KEYS[2], kv[i])
      if not s then table.insert(w.rebuild.debits, kv[i])
      elseif tonumber(s) > cutoff then used = used + tonumber(kv[i + 1]) end
    end
    local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. w.c, '+inf')
    for i = 1, #ids do
      if redis.call('HEXISTS', KEYS[3], ids[i]) == 0 then table.insert(w.rebuild.log, ids[i]) end
    end
  end
  w.used = used
  return w
end

local function tpm_holds(w, id)
  if redis.call('HEXISTS', KEYS[3], id) == 0 then return false end
  local s = redis.call('ZSCORE', KEYS[2], id)
  if s then return tonumber(s) > w.cutoff end
  return not w.rebuild
end

local function tpm_trim(w, window, keep)
  local function each(cmd, key, ids, skip)
    local part = {}
    for i = 1, #ids do
      if ids[i] ~= skip then part[#part + 1] = ids[i] end
      if #part == 256 or (i == #ids and #part > 0) then
        redis.call(cmd, key, unpack(part))
        part = {}
      end
    end
  end
  if w.rebuild then
    -- a refusal's or a re-sent call's one adding write: under noeviction at maxmemory Redis
    -- refuses it when nothing was written before, and the answer stands (the decision was made
    -- from w.used); the next admission rebuilds the sum. Any other error fails the script.
    local set = redis.pcall('SET', KEYS[4], w.used)
    if type(set) == 'table' and set.err and not string.find(set.err, 'maxmemory', 1, true) then error(set.err) end
  end
  if #w.expired > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', w.c)
    each('HDEL', KEYS[3], w.expired)
  end
  if w.rebuild then
    each('HDEL', KEYS[3], w.rebuild.debits)
    each('ZREM', KEYS[2], w.rebuild.log, keep)
    for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
  elseif w.freed ~= 0 then
    redis.call('DECRBY', KEYS[4], w.freed)
  end
end

local TPM_WALK_MAX = 1024

local function tpm_freed_at(need, now, batch)
  local freed, start, last = 0, 0, nil
  while start < TPM_WALK_MAX do
    local entries = redis.call('ZRANGE', KEYS[2], start, start + batch - 1, 'WITHSCORES')
    if #entries == 0 then return now end
    local ids = {}
    for i = 1, #entries, 2 do table.insert(ids, entries[i]) end
    local debits = redis.call('HMGET', KEYS[3], unpack(ids))
    for i = 1, #ids do
      freed = freed + (tonumber(debits[i]) or 0)
      last = tonumber(entries[2 * i])
      if freed >= need then return last end
    end
    start = start + batch
  end
  return last or now
end
