-- kvgate quota cancellation: undo reservations whose reserve call timed out. Redis may still
-- have run them (a paused server runs the commands waiting in its sockets when it resumes); the
-- gateway refused those requests, so they must not count. Leases never reserved are skipped.
-- KEYS: as reserve.lua (rpm log, tpm log, tpm debits, tpm sum, leases). ARGV: lease ids.
-- Returns how many reservations were undone.
local n = 0
for i = 1, #ARGV do
  local id = ARGV[i]
  local hit = redis.call('ZREM', KEYS[1], id) + redis.call('ZREM', KEYS[5], id)
  if redis.call('ZREM', KEYS[2], id) == 1 then hit = hit + 1 end
  local d = redis.call('HGET', KEYS[3], id)
  if d then
    redis.call('HDEL', KEYS[3], id)
    if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('DECRBY', KEYS[4], tonumber(d)) end  -- gone: rebuilt by tokens.lua
  end
  if hit > 0 then n = n + 1 end
end
return n
