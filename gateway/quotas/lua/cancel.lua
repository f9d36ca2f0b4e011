-- kvgate quota cancellation: undo reservations whose call failed (timed out, connection lost) or
-- whose caller left while it was out. Redis may have run them already, or may run them later (a
-- paused server runs the commands waiting in its sockets when it resumes; the network may deliver
-- an old connection's bytes after this script ran on a fresh one): the gateway refused those
-- requests (or the fallback decided them), so they must not count. Each lease id gets a tombstone
-- in the ended set (ended.lua): begin.lua, reserve.lua and tokens.lua for it change nothing
-- afterwards. Leases never reserved are skipped (and tombstoned).
-- KEYS: as reserve.lua (rpm log, tpm log, tpm debits, tpm sum, leases), KEYS[6] the ended set.
-- ARGV: keep_ms (how long tombstones live), keep_rpm 1|0, lease ids...
--   keep_rpm 1: a begun request whose token step failed and the fallback went on with (it may
--   reach an engine): its RPM entry stays, its lease and TPM debit go (the fallback holds them).
-- Returns how many reservations were undone (a request with anything removed counts once).
local keep = tonumber(ARGV[1])
local keep_rpm = ARGV[2] == '1'
local ids = {}
local n = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  table.insert(ids, id)
  local hit = redis.call('ZREM', KEYS[5], id)
  if not keep_rpm then hit = hit + redis.call('ZREM', KEYS[1], id) end
  if redis.call('ZREM', KEYS[2], id) == 1 then hit = hit + 1 end
  local d = redis.call('HGET', KEYS[3], id)
  if d then
    redis.call('HDEL', KEYS[3], id)
    if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('DECRBY', KEYS[4], tonumber(d)) end  -- gone: rebuilt by tokens.lua
  end
  if hit > 0 then n = n + 1 end
end
if #ids > 0 then
  local t = redis.call('TIME')
  remember_ended(ids, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), keep)
end
return n
