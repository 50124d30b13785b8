"""Server-side Redis scripts of the tracker election: the lease and the partitions' fences.

Key layout as documented in :mod:`tracker.core.keys`; the election itself is
``tracker/ingest/lease.py``, and :data:`tracker.core.lua.APPLY` checks the fence.
"""

from __future__ import annotations

from typing import Final

# The tracker election (tracker/ingest/lease.py). KEYS: [lease, fencing counter]. The lease holds
# "<fencing number> <tracker id>" and expires unless its holder renews it.
# ARGV: [tracker id, ttl ms]. Returns the holder's fencing number when the caller holds the
# lease now (newly won: the counter's next number), 0 when another tracker does.
LEASE_ACQUIRE: Final = """
local held = redis.call('GET', KEYS[1])
if held then
  local number, holder = string.match(held, '^(%d+) (.*)$')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(number)
  end
  return 0
end
local number = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], number .. ' ' .. ARGV[1], 'PX', ARGV[2])
return number
"""

# KEYS: [lease]. ARGV: [the holder's lease value, ttl ms (renew) or "" (release)].
# Returns 1 if the caller still held the lease (renewed or released), 0 if it did not.
LEASE_KEEP: Final = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
"""

# KEYS: [partition fence]. ARGV: [fencing number]. Raises the partition's fence to it (a new
# tracker claims the partitions before it reads them); returns the fence now.
FENCE_RAISE: Final = """
local newest = tonumber(redis.call('GET', KEYS[1]) or '0')
local fence = tonumber(ARGV[1])
if fence > newest then
  redis.call('SET', KEYS[1], fence)
  return fence
end
return newest
"""
