"""Server-side Redis scripts of the index; key layout as documented in :mod:`tracker.keys`.

Block-bucket values are strings of 2-byte entries, one per replica: ``rid << 2 | tiers``
(``tiers`` bit 0 = GPU, bit 1 = offload). Scripts declare every key they touch, and all keys
of one call share a hash tag, so they run unchanged on Redis Cluster.
"""

from __future__ import annotations

from typing import Final

# KEYS: [seq hash, block bucket x P, engine bucket x E]
# ARGV: [replica, seq ("" keep, "-" delete, else set), rid, P,
#        P x (8-byte block key .. 1-byte tiers), E x (8-byte engine hash [.. 12-byte value])]
APPLY: Final = """
local replica, seq, rid, np = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local hi = math.floor(rid / 64)
local lo = (rid % 64) * 4
for i = 1, np do
  local op = ARGV[4 + i]
  local key = KEYS[1 + i]
  local f = string.sub(op, 1, 8)
  local tiers = string.byte(op, 9)
  local v = redis.call('HGET', key, f)
  local out = {}
  if v then
    for j = 1, #v - 1, 2 do
      local b1, b2 = string.byte(v, j, j + 1)
      if b1 ~= hi or b2 - (b2 % 4) ~= lo then out[#out + 1] = string.sub(v, j, j + 1) end
    end
  end
  if tiers > 0 then out[#out + 1] = string.char(hi, lo + tiers) end
  if #out == 0 then
    if v then redis.call('HDEL', key, f) end
  else
    redis.call('HSET', key, f, table.concat(out))
  end
end
for i = 5 + np, #ARGV do
  local op = ARGV[i]
  local key = KEYS[i - 3]
  if #op > 8 then
    redis.call('HSET', key, string.sub(op, 1, 8), string.sub(op, 9))
  else
    redis.call('HDEL', key, op)
  end
end
if seq == '-' then
  redis.call('HDEL', KEYS[1], replica)
elseif seq ~= '' then
  redis.call('HSET', KEYS[1], replica, seq)
end
return np
"""

# KEYS: [rname hash, block bucket x N]; ARGV: [8-byte block key x N]
# Returns a flat array [replica, matched blocks, matched GPU blocks, ...].
LOOKUP: Final = """
local runs = {}
local order = {}
for i = 1, #ARGV do
  local v = redis.call('HGET', KEYS[i + 1], ARGV[i])
  if not v then break end
  local advanced = false
  for j = 1, #v - 1, 2 do
    local b1, b2 = string.byte(v, j, j + 1)
    local t = b2 % 4
    local rid = b1 * 64 + (b2 - t) / 4
    local run = runs[rid]
    if i == 1 then
      run = {0, 0}
      runs[rid] = run
      order[#order + 1] = rid
    end
    if run and run[1] == i - 1 then
      run[1] = i
      if t % 2 == 1 then run[2] = run[2] + 1 end
      advanced = true
    end
  end
  if not advanced then break end
end
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
RID: Final = """
local r = redis.call('HGET', KEYS[1], ARGV[1])
if r then return tonumber(r) end
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
return r
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
