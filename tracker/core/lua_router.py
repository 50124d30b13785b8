"""Server-side Redis scripts of the routers: the writes after routing and the shared load.

A router records each request it routes (:data:`PREDICT`, :data:`CLAIM`, or both in one call,
:data:`ROUTE`) and shares its load with the other routers (:data:`LOAD_PUT`,
:data:`LOAD_SNAPSHOT`; :mod:`router.redis_load`). Key layout as documented in
:mod:`tracker.core.keys`; every key a call touches shares the hash tag of the keys it declares.
"""

from __future__ import annotations

from typing import Final

from tracker.core.lua_lib import BUCKETS, PREDICTIONS

# The shared router load (tracker.core.keys: ``load``), for router.redis_load: PUT writes one
# router's totals, load_snapshot sums the others' live entries, pruning expired ones.
# KEYS: [load hash]; ARGV: [router id, ttl ms, then (replica, inflight, tokens, age ms)
# quadruples]; age: how long ago the router sent its oldest request there that is still
# prefilling (stored as Redis time, so router clocks never matter).
# A zero total deletes the field. The hash itself expires 2 ttl after the last write, so a
# partition whose routers all died disappears even if nobody reads it again.
LOAD_PUT: Final = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ttl = tonumber(ARGV[2])
local written = 0
for i = 3, #ARGV - 3, 4 do
  local field = ARGV[i] .. '\\0' .. ARGV[1]
  local n, q = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  if n == 0 and q == 0 then
    redis.call('HDEL', KEYS[1], field)
  else
    local since = now - tonumber(ARGV[i + 3])
    redis.call('HSET', KEYS[1], field, struct.pack('<dddd', n, q, now + ttl, since))
    written = written + 1
  end
end
if written > 0 and redis.call('PTTL', KEYS[1]) < 2 * ttl then
  redis.call('PEXPIRE', KEYS[1], 2 * ttl)
end
return written
"""


# load_snapshot(load hash, router id whose entries to skip, ttl ms): [replica, inflight,
# tokens, age ms, ...] summed over the other routers' live entries; age: since the oldest of
# their requests there still prefilling was sent (0: none known). The reader's presence is
# written too (field ``NUL router``, zero totals, expiring after ttl): another router's comes
# back as replica "" with zeros, so a router learns that it is not alone even before the
# others route. A 24-byte value (written before entries carried their age) counts with age 0.
LOAD_SNAPSHOT_FN: Final = """
local function load_snapshot(key, skip, ttl)
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  redis.call('HSET', key, '\\0' .. skip, struct.pack('<dddd', 0, 0, now + ttl, now))
  if redis.call('PTTL', key) < 2 * ttl then redis.call('PEXPIRE', key, 2 * ttl) end
  local all = redis.call('HGETALL', key)
  local sums, order, dead = {}, {}, {}
  for i = 1, #all, 2 do
    local field, value = all[i], all[i + 1]
    local replica, router = string.match(field, '^(.*)%z(.-)$')
    local n, q, expiry, since
    if replica ~= nil and #value == 32 then
      n, q, expiry, since = struct.unpack('<dddd', value)
    elseif replica ~= nil and #value == 24 then
      n, q, expiry = struct.unpack('<ddd', value)
      since = now
    end
    if expiry == nil or expiry <= now then
      dead[#dead + 1] = field
    elseif router ~= skip then
      local s = sums[replica]
      if not s then
        s = {0, 0, now}
        sums[replica] = s
        order[#order + 1] = replica
      end
      s[1] = s[1] + n
      s[2] = s[2] + q
      if q > 0 and since < s[3] then s[3] = since end
    end
  end
  for i = 1, #dead, 1000 do
    redis.call('HDEL', key, unpack(dead, i, math.min(i + 999, #dead)))
  end
  local out = {}
  for _, replica in ipairs(order) do
    local s = sums[replica]
    out[#out + 1] = replica
    out[#out + 1] = s[1]
    out[#out + 1] = s[2]
    out[#out + 1] = math.max(0, now - s[3])
  end
  return out
end
"""

# KEYS: [load hash]; ARGV: [router id whose entries to skip, its presence's ttl ms].
LOAD_SNAPSHOT: Final = (
    LOAD_SNAPSHOT_FN + "return load_snapshot(KEYS[1], ARGV[1], tonumber(ARGV[2]))\n"
)

# The routers' two writes after routing a request, as Lua functions of one script each and of
# ROUTE, which makes both in one call. ``rid`` has been checked against the replica's name.
#
# claim: records replica ``rid`` as the home of each anchor (8-byte block keys): rid (2 B),
# the Redis time of the claim (6 B), its expiry (6 B); the bucket keys expire ttl after
# their newest record. A bucket that keeps being written never expires, so each call also
# drops the expired records of one of the buckets it writes (a different one each
# millisecond): every bucket is swept about as often as it is written.
# predict: records that replica ``rid`` will hold these blocks until now + ttl (dropping
# expired entries and its own older entry on the way).
_ROUTED: Final = (
    BUCKETS
    + PREDICTIONS
    + """
local function claim(hprefix, rid, ttl, anchors, clock)
  local n = #anchors / 8
  if n == 0 then return 0 end
  local mine = string.char(math.floor(rid / 256), rid % 256) .. pack_expiry(clock)
    .. pack_expiry(clock + ttl)
  local sweep = clock % n
  for i = 0, n - 1 do
    local f = string.sub(anchors, i * 8 + 1, i * 8 + 8)
    local key = block_bucket(hprefix, f)
    if i == sweep then
      local all = redis.call('HGETALL', key)
      for j = 1, #all, 2 do
        local v = all[j + 1]
        if #v < 14 or expiry_of(v, 7) <= clock then redis.call('HDEL', key, all[j]) end
      end
    end
    redis.call('HSET', key, f, mine)
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
  return n
end
local function predict(prefix, rid, ttl, chain, clock)
  if #chain == 0 then return 0 end
  local pprefix = prefix .. ':p:'
  local mine = string.char(math.floor(rid / 256), rid % 256) .. pack_expiry(clock + ttl)
  for i = 1, #chain - 7, 8 do
    local f = string.sub(chain, i, i + 7)
    local key = block_bucket(pprefix, f)
    local v = redis.call('HGET', key, f)
    local out = {mine}
    if v then
      for j = 1, #v - 7, 8 do
        local b1, b2 = string.byte(v, j, j + 1)
        if b1 * 256 + b2 ~= rid and expiry_of(v, j) > clock then
          out[#out + 1] = string.sub(v, j, j + 7)
        end
      end
    end
    redis.call('HSET', key, f, table.concat(out))
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
  local plive = prefix .. ':plive'
  if redis.call('PTTL', plive) < ttl then redis.call('SET', plive, '1', 'PX', ttl) end
  return #chain / 8
end
"""
)

# KEYS: [rname hash]; ARGV: [key prefix with hash tag, rid, ttl ms, anchor block keys (8 bytes
# each), replica name]. Returns the anchors claimed, or -1, writing nothing, when the rid no
# longer belongs to that replica.
CLAIM: Final = (
    _ROUTED
    + """
local rid = tonumber(ARGV[2])
if redis.call('HGET', KEYS[1], rid) ~= ARGV[5] then return -1 end
return claim(ARGV[1] .. ':h:', rid, tonumber(ARGV[3]), ARGV[4], now_ms())
"""
)

# KEYS: [rname hash]; ARGV: [key prefix with hash tag, rid, ttl ms, n x 8-byte block key,
# replica name]. Returns the blocks predicted, or -1, writing nothing, when the rid no longer
# belongs to that replica (Redis lost data, or the rid was released and reused).
PREDICT: Final = (
    _ROUTED
    + """
local rid = tonumber(ARGV[2])
if redis.call('HGET', KEYS[1], rid) ~= ARGV[5] then return -1 end
return predict(ARGV[1], rid, tonumber(ARGV[3]), ARGV[4], now_ms())
"""
)

# KEYS: [rname hash]; ARGV: [key prefix with hash tag, rid, replica name, prediction ttl ms,
# predicted block keys, home ttl ms, anchor block keys] (8 bytes per key). PREDICT and CLAIM
# in one call: what a router writes after each request it routes. Returns 0, or -1, writing
# nothing, when the rid no longer belongs to that replica.
ROUTE: Final = (
    _ROUTED
    + """
local rid = tonumber(ARGV[2])
if redis.call('HGET', KEYS[1], rid) ~= ARGV[3] then return -1 end
local clock = now_ms()
predict(ARGV[1], rid, tonumber(ARGV[4]), ARGV[5], clock)
claim(ARGV[1] .. ':h:', rid, tonumber(ARGV[6]), ARGV[7], clock)
return 0
"""
)
