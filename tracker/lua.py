"""Server-side Redis scripts of the index; key layout as documented in :mod:`tracker.keys`.

Block-bucket values are strings of 2-byte entries, one per replica: ``rid << 2 | tiers``
(``tiers`` bit 0 = GPU, bit 1 = offload). Scripts declare every key they touch, and all keys
of one call share a hash tag, so they run unchanged on Redis Cluster.
"""

from __future__ import annotations

from typing import Final

# Bucket key names are derived here from the partition's key prefix (ARGV), so a call carries
# a few large arguments instead of one per block (argument packing dominated client CPU).
# Every key touched shares the hash tag of the declared key, so the call is routed to the
# node owning that slot and never crosses slots.
_BUCKETS: Final = """
local hex = {}
for i = 0, 255 do hex[i] = string.format('%02x', i) end
local function block_bucket(prefix, f)
  local b1, b2 = string.byte(f, 1, 2)
  return prefix .. hex[b1] .. hex[b2]
end
local function engine_bucket(prefix, f)
  local b7, b8 = string.byte(f, 7, 8)
  return prefix .. (b7 % 4) .. hex[b8]
end
"""

# KEYS: [seq hash]
# ARGV: [replica, seq ("" keep, "-" delete, else set), rid, key prefix with hash tag,
#        placements: n x (8-byte block key .. 1-byte tiers),
#        engine ops: n x (8-byte engine hash .. 1-byte flag (1 set, 0 delete) .. 12-byte value)]
APPLY: Final = _BUCKETS + """
local replica, seq, rid, tag = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local places, engine = ARGV[5], ARGV[6]
local bprefix, eprefix = tag .. ':b:', tag .. ':e:' .. rid .. ':'
local hi = math.floor(rid / 64)
local lo = (rid % 64) * 4
for i = 1, #places - 8, 9 do
  local f = string.sub(places, i, i + 7)
  local tiers = string.byte(places, i + 8)
  local key = block_bucket(bprefix, f)
  local v = redis.call('HGET', key, f)
  if not v then
    if tiers > 0 then redis.call('HSET', key, f, string.char(hi, lo + tiers)) end
  else
    local out = {}
    for j = 1, #v - 1, 2 do
      local b1, b2 = string.byte(v, j, j + 1)
      if b1 ~= hi or b2 - (b2 % 4) ~= lo then out[#out + 1] = string.sub(v, j, j + 1) end
    end
    if tiers > 0 then out[#out + 1] = string.char(hi, lo + tiers) end
    if #out == 0 then
      redis.call('HDEL', key, f)
    else
      redis.call('HSET', key, f, table.concat(out))
    end
  end
end
for i = 1, #engine - 20, 21 do
  local f = string.sub(engine, i, i + 7)
  local key = engine_bucket(eprefix, f)
  if string.byte(engine, i + 8) == 1 then
    redis.call('HSET', key, f, string.sub(engine, i + 9, i + 20))
  else
    redis.call('HDEL', key, f)
  end
end
if seq == '-' then
  redis.call('HDEL', KEYS[1], replica)
elseif seq ~= '' then
  redis.call('HSET', KEYS[1], replica, seq)
end
return #places / 9
"""

# KEYS: [rname hash]; ARGV: [key prefix with hash tag, n x 8-byte block key]
# Returns a flat array [replica, matched blocks, matched GPU blocks, ...].
# Consecutive blocks held by the same replicas carry identical values (Lua strings are
# interned, so comparing them is O(1)); such runs are counted without re-parsing entries.
LOOKUP: Final = _BUCKETS + """
local bprefix, chain = ARGV[1] .. ':b:', ARGV[2]
local runs, order, advanced = {}, {}, {}
local depth, prev, pending = 0, nil, 0
local function settle()
  for _, a in ipairs(advanced) do
    a[1][1] = a[1][1] + pending
    if a[2] then a[1][2] = a[1][2] + pending end
  end
  depth = depth + pending
  pending = 0
end
for i = 1, #chain - 7, 8 do
  local f = string.sub(chain, i, i + 7)
  local v = redis.call('HGET', block_bucket(bprefix, f), f)
  if not v then break end
  if v == prev then
    pending = pending + 1
  else
    settle()
    local now = {}
    for j = 1, #v - 1, 2 do
      local b1, b2 = string.byte(v, j, j + 1)
      local t = b2 % 4
      local rid = b1 * 64 + (b2 - t) / 4
      local run = runs[rid]
      if depth == 0 then
        run = {0, 0}
        runs[rid] = run
        order[#order + 1] = rid
      end
      if run and run[1] == depth then
        now[#now + 1] = {run, t % 2 == 1}
      end
    end
    if #now == 0 then break end
    advanced, prev, pending = now, v, 1
  end
end
settle()
if #order == 0 then return {} end
local names = redis.call('HMGET', KEYS[1], unpack(order))
local out = {}
for k, rid in ipairs(order) do
  if names[k] then
    out[#out + 1] = names[k]
    out[#out + 1] = runs[rid][1]
    out[#out + 1] = runs[rid][2]
  end
end
return out
"""

# KEYS: [rid hash, rname hash, ridseq, free rid set]; ARGV: [replica, max rid]
# Returns [rid, 1 if newly allocated else 0].
RID: Final = """
local r = redis.call('HGET', KEYS[1], ARGV[1])
if r then return {tonumber(r), 0} end
r = redis.call('SPOP', KEYS[4])
if r then
  r = tonumber(r)
else
  r = redis.call('INCR', KEYS[3])
  if r > tonumber(ARGV[2]) then
    redis.call('DECR', KEYS[3])
    return redis.error_reply('kvrouter: replica id space of this namespace is exhausted')
  end
end
redis.call('HSET', KEYS[1], ARGV[1], r)
redis.call('HSET', KEYS[2], r, ARGV[1])
return {r, 1}
"""

# KEYS: [rid hash, rname hash, free rid set]; ARGV: [replica]
RELEASE_RID: Final = """
local r = redis.call('HGET', KEYS[1], ARGV[1])
if not r then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], r)
redis.call('SADD', KEYS[3], r)
return 1
"""

# KEYS: [replicas, replicas:seen]; ARGV: [replica id, JSON record]
HEARTBEAT: Final = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], t[1] * 1000 + math.floor(t[2] / 1000))
return 1
"""

# KEYS: [replicas, replicas:seen]. Returns [now ms, id, last seen ms, JSON, ...] for every
# registered replica (used for listing and, with ARGV[1] == "reap", to remove stale ones).
REGISTRY: Final = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local out = {now}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local id, record = all[i], all[i + 1]
  local seen = tonumber(redis.call('HGET', KEYS[2], id) or '0')
  local stale = false
  if ARGV[1] == 'reap' then
    local ok, parsed = pcall(cjson.decode, record)
    local ttl = 15
    if ok and type(parsed) == 'table' and tonumber(parsed['ttl_s']) then
      ttl = tonumber(parsed['ttl_s'])
    end
    stale = now - seen > ttl * 1000
    if stale then
      redis.call('HDEL', KEYS[1], id)
      redis.call('HDEL', KEYS[2], id)
    end
  end
  if ARGV[1] ~= 'reap' or stale then
    out[#out + 1] = id
    out[#out + 1] = seen
    out[#out + 1] = record
  end
end
return out
"""
