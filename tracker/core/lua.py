"""Every server-side Redis script of kvrouter, and the Lua snippets they share.

Sections: the shared snippets (bucket names, entry layout, clocks, the load snapshot), the
index's scripts, the routers' (:mod:`router.shared.redis_load` too) and the tracker election's. Key
names and the layout constants interpolated here come from :mod:`tracker.core.keys`; every
key a call touches shares the hash tag of the keys it declares (one Redis Cluster slot).
"""

from __future__ import annotations

from typing import Final

from tracker.core.keys import (
    BLOCK_BUCKET_BITS,
    ENGINE_BUCKETS,
    ENGINE_VALUE_BYTES,
    PREDICTION_SLOT_MS,
    TIER_BITS,
)

# ----------------------------------------------------------- shared snippets

# Bucket key names are derived here from the partition's key prefix (ARGV), so a call carries
# a few large arguments instead of one per block (argument packing dominated client CPU).
# Every key touched shares the hash tag of the declared key, so the call is routed to the
# node owning that slot and never crosses slots.
_HEX_TABLE: Final = "local hex = {[0] = " + ", ".join(f"'{i:02x}'" for i in range(256)) + "}"
BUCKETS: Final = (
    _HEX_TABLE
    + """
local function block_bucket(prefix, f)
  local b1, b2 = string.byte(f, 1, 2)
  local b = math.floor((b1 * 256 + b2) / """
    + str(1 << (16 - BLOCK_BUCKET_BITS))
    + """)
  return prefix .. hex[math.floor(b / 256)] .. hex[b % 256]
end
local function engine_bucket(prefix, f)
  local b7, b8 = string.byte(f, 7, 8)
  return prefix .. (b7 % """
    + str(ENGINE_BUCKETS >> 8)
    + """) .. hex[b8]
end
"""
)


def _slot(tiers: int) -> int:
    """A run's count (Lua index) that a block in ``tiers`` adds to: 2 + its best tier's bit."""
    return 2 + (tiers & -tiers).bit_length() - 1


# Segment entries and segment predictions are read hundreds of fields per HMGET: a hash in
# Redis' compact listpack encoding is scanned once per field asked, so each such hash holds a
# field "" with a value longer than any listpack keeps (hash-max-listpack-value, 64 by
# default), which makes Redis keep it as a hashtable from its first write.
_HASHTABLE: Final = "local HASHTABLE = string.rep('-', 1024)\n"

# The entry layout of block buckets: rid in the high bits (R rids per high byte), tiers in the
# low TIER_BITS (M values); engine-map values are E bytes; segment-bucket entries are rid
# (2 bytes) + blocks per tier (TB bytes); SLOT[tiers] is where a lookup run counts a block
# (2 GPU, 3 CPU, 4 storage, 5 remote: the cheapest tier it is in).
LAYOUT: Final = (
    f"local R, M, E, TB = {1 << (8 - TIER_BITS)}, {1 << TIER_BITS}, {ENGINE_VALUE_BYTES}, "
    f"{TIER_BITS}\n"
    + "local SLOT = {"
    + ", ".join(f"[{t}] = {_slot(t)}" for t in range(1, 1 << TIER_BITS))
    + "}\n"
)

# Prediction buckets (``p:``) hold, per block key, 8-byte entries: rid (2 bytes) + expiry in
# Redis server time (6 bytes, ms). The router writes them after routing (predict-on-route).
# A segment predicted whole is one such entry in the hash ``ps:<slot>`` of its expiry's slot
# (W ms wide; the hash expires with its slot), keyed by the segment's last block.
PREDICTIONS: Final = (
    f"local W = {PREDICTION_SLOT_MS}\n"
    + """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function expiry_of(v, j)
  local e1, e2, e3, e4, e5, e6 = string.byte(v, j + 2, j + 7)
  return ((((e1 * 256 + e2) * 256 + e3) * 256 + e4) * 256 + e5) * 256 + e6
end
local function pack_expiry(ms)
  local out = {}
  for k = 6, 1, -1 do
    out[k] = string.char(ms % 256)
    ms = math.floor(ms / 256)
  end
  return table.concat(out)
end
"""
)


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


# ----------------------------------------------------------- the index

# KEYS: [seq hash, rid hash, rname hash, ridseq, free rid set, partition fence of the
#        writer's election]
# ARGV: [replica, seq ("" keep, "-" delete, else set), rid, key prefix with hash tag,
#        placements: n x (8-byte block key .. 1-byte tiers),
#        engine ops: n x (8-byte engine hash .. 1-byte flag (1 set, 0 delete) .. E-byte value),
#        the writing tracker's fencing number (0: not elected, not fenced),
#        segments: n x (8-byte key of a segment's last block .. its blocks per tier, one byte
#        each; all zero: the replica no longer holds it whole),
#        segment ends the batch stored or removed: n x 8-byte block key (their segments'
#        predictions of this replica end)]
# Returns APPLY_OK; APPLY_RID_RESTORED when the rid mapping was missing and has been put back
# (Redis lost its data: the caller must write the replica's whole state again); or
# APPLY_RID_TAKEN, having written nothing, when another replica owns the rid now (the caller
# must allocate a new one); APPLY_FENCED, having written nothing, when a tracker elected after
# the writer has written the partition (the writer lost its lease and must stop).
APPLY_OK: Final = 0
APPLY_RID_RESTORED: Final = 1
APPLY_RID_TAKEN: Final = -1
APPLY_FENCED: Final = -2
APPLY: Final = (
    BUCKETS
    + LAYOUT
    + _HASHTABLE
    + f"local W = {PREDICTION_SLOT_MS}\n"
    + """
local replica, seq, rid, tag = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local places, engine = ARGV[5], ARGV[6]
local fence = tonumber(ARGV[7])
if fence > 0 then
  local newest = tonumber(redis.call('GET', KEYS[6]) or '0')
  if fence < newest then return -2 end
  if fence > newest then redis.call('SET', KEYS[6], fence) end
end
local status = 0
local owner = redis.call('HGET', KEYS[3], rid)
if owner ~= replica then
  if owner or redis.call('HGET', KEYS[2], replica) then return -1 end
  redis.call('HSET', KEYS[2], replica, rid)
  redis.call('HSET', KEYS[3], rid, replica)
  redis.call('SREM', KEYS[5], rid)
  if tonumber(redis.call('GET', KEYS[4]) or '0') < rid then redis.call('SET', KEYS[4], rid) end
  status = 1
end
local bprefix, eprefix = tag .. ':b:', tag .. ':e:' .. rid .. ':'
local pprefix = tag .. ':p:'
local hi = math.floor(rid / R)
local lo = (rid % R) * M
-- the engine's word on a block ends this replica's prediction of it (stored: superseded;
-- removed: wrong from now on); checked only while some prediction may be live
local live = redis.call('EXISTS', tag .. ':plive') == 1
-- the engine's word on a block ends this replica's prediction of it (block or whole segment)
local function unpredict(pkey, f)
  local p = redis.call('HGET', pkey, f)
  if not p then return end
  local keep = {}
  for j = 1, #p - 7, 8 do
    local b1, b2 = string.byte(p, j, j + 1)
    if b1 * 256 + b2 ~= rid then keep[#keep + 1] = string.sub(p, j, j + 7) end
  end
  if #keep == 0 then
    redis.call('HDEL', pkey, f)
  elseif #keep * 8 < #p then
    redis.call('HSET', pkey, f, table.concat(keep))
  end
end
local held, stored = 0, 0
for i = 1, #places - 8, 9 do
  local f = string.sub(places, i, i + 7)
  local tiers = string.byte(places, i + 8)
  local key = block_bucket(bprefix, f)
  local v = redis.call('HGET', key, f)
  local old = 0
  if not v then
    if tiers > 0 then redis.call('HSET', key, f, string.char(hi, lo + tiers)) end
  else
    local out = {}
    for j = 1, #v - 1, 2 do
      local b1, b2 = string.byte(v, j, j + 1)
      if b1 ~= hi or b2 - (b2 % M) ~= lo then
        out[#out + 1] = string.sub(v, j, j + 1)
      else
        old = b2 % M
      end
    end
    if tiers > 0 then out[#out + 1] = string.char(hi, lo + tiers) end
    if #out == 0 then
      redis.call('HDEL', key, f)
    else
      redis.call('HSET', key, f, table.concat(out))
    end
  end
  local gained = tiers % 2 - old % 2
  held = held + gained
  if gained > 0 then stored = stored + 1 end
  if live then unpredict(block_bucket(pprefix, f), f) end
end
if held ~= 0 then redis.call('HINCRBY', tag .. ':stats', 'n:' .. replica, held) end
if stored > 0 then redis.call('HINCRBY', tag .. ':stats', 's:' .. replica, stored) end
for i = 1, #engine - E - 8, E + 9 do
  local f = string.sub(engine, i, i + 7)
  local key = engine_bucket(eprefix, f)
  if string.byte(engine, i + 8) == 1 then
    redis.call('HSET', key, f, string.sub(engine, i + 9, i + 8 + E))
  else
    redis.call('HDEL', key, f)
  end
end
local segments, key = ARGV[8] or '', tag .. ':s'
local mine, none = string.char(math.floor(rid / 256), rid % 256), string.rep('\0', TB)
if #segments > 0 then redis.call('HSETNX', key, '', HASHTABLE) end
for i = 1, #segments - 7 - TB, 8 + TB do
  local f = string.sub(segments, i, i + 7)
  local counts = string.sub(segments, i + 8, i + 7 + TB)
  local v = redis.call('HGET', key, f)
  local out = {}
  if v then
    for j = 1, #v - 1 - TB, 2 + TB do
      if string.sub(v, j, j + 1) ~= mine then out[#out + 1] = string.sub(v, j, j + 1 + TB) end
    end
  end
  if counts ~= none then out[#out + 1] = mine .. counts end
  if #out == 0 then
    if v then redis.call('HDEL', key, f) end
  else
    redis.call('HSET', key, f, table.concat(out))
  end
end
-- the engine's word on a segment's last block ends this replica's prediction of the segment
local touched = ARGV[9] or ''
if live and #touched > 0 then
  local t = redis.call('TIME')
  local clock = t[1] * 1000 + math.floor(t[2] / 1000)
  local left = redis.call('PTTL', tag .. ':plive')
  for slot = math.floor(clock / W), math.floor((clock + math.max(left, 0)) / W) do
    local pkey = tag .. ':ps:' .. slot
    for i = 1, #touched - 7, 8 do unpredict(pkey, string.sub(touched, i, i + 7)) end
  end
end
if seq == '-' then
  redis.call('HDEL', KEYS[1], replica)
elseif seq ~= '' then
  redis.call('HSET', KEYS[1], replica, seq)
end
return status
"""
)


# KEYS: [rname hash, optionally the load hash]; ARGV: [key prefix with hash tag, n x 8-byte
# block key, blocks per segment, with the load hash: the router id whose entries to skip
# (else ''), its presence's ttl ms (else 0), a session key (8 bytes, or ''), then the keys of
# the chain's segment ends (its blocks S-1, 2S-1, ...), one argument each]
# Returns {matches, stats, homes, load, lookahead, session, lives}: session [replica, age ms]
# of the session key's live home record, or empty; lives [replica, sessions, ...]: with a
# session key, each replica's other live sessions (``ss:<rid>``, ROUTE), those with any;
# lookahead the partition's lookahead hash (replica -> tokens after each block its engine
# hashes, tracker.core.keys); load_snapshot of the
# load hash when given (one round trip for a router's whole view), else empty; matches a flat
# array [replica, matched blocks, GPU, CPU, storage, remote, predicted blocks, ...]; stats the
# partition's whole stats hash (HGETALL), for every replica; homes [replica, depth in blocks,
# age ms, ...]: the home records of the chain's anchors (tracker.core.keys.home_anchors), walked
# from the first while each has one, every replica with the deepest anchor that names it.
# Phase 1 walks real placements. It reads every segment's entry first (``s``, keyed by the
# segment's last block: the chain up to it is the prompt's), in one HMGET; at each segment
# boundary, when every replica still matching holds the segment whole, they all skip it with
# the counts per tier the tracker keeps, so a cached prefix costs a field of one HMGET per
# segment, not a read per block. Elsewhere it
# walks blocks: consecutive blocks held by the same replicas carry identical values (Lua
# strings are interned, so comparing them is O(1)); such runs are counted without re-parsing
# entries. Phase 2 starts where no replica still matching holds the next block and
# extends those replicas (any replica, if nothing matched) with unexpired predictions or late
# real placements, block by block. Bucket names are built from a cached head (one per first
# key byte) and a one-byte hex tail, with local aliases of the library functions.
_HEAD_DIVISOR: Final = 1 << (16 - BLOCK_BUCKET_BITS)  # first key byte -> bucket name's head
assert 8 <= BLOCK_BUCKET_BITS <= 16, "bucket names split into a head and a one-byte tail"
LOOKUP: Final = (
    BUCKETS
    + LAYOUT
    + PREDICTIONS
    + LOAD_SNAPSHOT_FN
    + f"local D = {_HEAD_DIVISOR}\n"
    + """
local bprefix, pprefix, chain = ARGV[1] .. ':b:', ARGV[1] .. ':p:', ARGV[2]
local S = tonumber(ARGV[3])
local runs, order, advanced = {}, {}, {}
local depth, prev, pending = 0, nil, 0
local i = 1
local function settle()
  for _, a in ipairs(advanced) do
    a[1][1] = a[1][1] + pending
    a[1][a[2]] = a[1][a[2]] + pending
  end
  depth = depth + pending
  pending = 0
end
local function run_of(rid)
  local run = runs[rid]
  if not run and depth == 0 then
    run = {0, 0, 0, 0, 0, 0}
    runs[rid] = run
    order[#order + 1] = rid
  end
  return run
end
local sub, byte, floor, call = string.sub, string.byte, math.floor, redis.call
local last, heads = #chain - 7, {}
-- every segment's holders at once (ARGV[7..]: the keys of the chain's segment ends)
local ends, nends = nil, #ARGV - 6
local function load_ends()  -- once, and only when some replica holds the first block
  if ends then return end
  ends = {}
  for k = 7, #ARGV, 1000 do
    local got = call('HMGET', ARGV[1] .. ':s', unpack(ARGV, k, math.min(k + 999, #ARGV)))
    for _, v in ipairs(got) do ends[#ends + 1] = v end
  end
end
if last > 0 and call('HGET', block_bucket(bprefix, sub(chain, 1, 8)), sub(chain, 1, 8)) then
  load_ends()
end
-- a segment every replica still matching holds whole: all of them skip it; the next segment
-- with the same value (interned: an O(1) comparison) moves the same runs by the same counts
local skipped_value, moves = nil, {}
local function move(times)
  for _, m in ipairs(moves) do
    local run = m[1]
    run[1], run[2], run[3] = run[1] + S * times, run[2] + m[2] * times, run[3] + m[3] * times
    run[4], run[5] = run[4] + m[4] * times, run[5] + m[5] * times
  end
  depth = depth + S * times
end
local function skip(whole)
  local at = {}
  for j = 1, #whole - 1 - TB, 2 + TB do
    local b1, b2 = byte(whole, j, j + 1)
    at[b1 * 256 + b2] = j
  end
  local now = {}
  for _, rid in ipairs(order) do
    local run = runs[rid]
    if run[1] == depth then
      local j = at[rid]
      if not j then return false end
      local g, c, st, rm = byte(whole, j + 2, j + 5)
      now[#now + 1] = {run, g, c, st, rm}
    end
  end
  if #now == 0 then return false end
  skipped_value, moves = whole, now
  move(1)
  return true
end
while i <= last do
  local skipped = false
  local k = (i - 1) / (8 * S) + 1
  local whole = k == floor(k) and ends and ends[k]
  if whole and whole == skipped_value then  -- nothing walked since: the same runs go on
    local times = 1
    while ends[k + times] == whole do times = times + 1 end
    move(times)
    i, skipped = i + 8 * S * times, true
  elseif whole then
    settle()
    if depth == 0 then  -- the candidates: the first block's holders
      local first = sub(chain, 1, 8)
      local v = call('HGET', block_bucket(bprefix, first), first) or ''
      for j = 1, #v - 1, 2 do
        local r1, r2 = byte(v, j, j + 1)
        run_of(r1 * R + (r2 - r2 % M) / M)
      end
    end
    skipped = skip(whole)
    if skipped then
      i = i + 8 * S
      advanced, prev = {}, nil
    end
  end
  if not skipped then
    skipped_value = nil
    local f = sub(chain, i, i + 7)
    local b1, b2 = byte(f, 1, 2)
    local head = heads[b1]
    if not head then
      head = bprefix .. hex[floor(b1 / D)]
      heads[b1] = head
    end
    local v = call('HGET', head .. hex[(b1 % D) * (256 / D) + floor(b2 / D)], f)
    if not v then break end
    if v == prev then
      pending = pending + 1
    else
      settle()
      local now = {}
      for j = 1, #v - 1, 2 do
        local r1, r2 = byte(v, j, j + 1)
        local t = r2 % M
        local run = run_of(r1 * R + (r2 - t) / M)
        if run and run[1] == depth then now[#now + 1] = {run, SLOT[t]} end
      end
      if #now == 0 then break end
      advanced, prev, pending = now, v, 1
    end
    i = i + 8
  end
end
settle()
local clock = nil
-- phase 2's segments predicted whole: per segment of the chain, the rids predicted to hold it
local predicted, parsed, raw = {}, {}, {}
local left = i <= last and call('PTTL', ARGV[1] .. ':plive') or -2
local k0 = floor((i - 1) / (8 * S)) + 1
if left > 0 and k0 <= nends then
  clock = now_ms()
  for slot = floor(clock / W), floor((clock + left) / W) do
    local key = ARGV[1] .. ':ps:' .. slot
    for c = k0 + 6, #ARGV, 1000 do  -- ends[k] is ARGV[k + 6]
      local got = call('HMGET', key, unpack(ARGV, c, math.min(c + 999, #ARGV)))
      for x = 1, #got do
        local p = got[x]
        if p then  -- entries of several slots: one list
          local k = c - 7 + x
          raw[k] = (raw[k] or '') .. p
        end
      end
    end
  end
  for k, p in pairs(raw) do
    local rids = parsed[p]  -- a route writes the same value into all its segments
    if not rids then
      rids = {}
      for j = 1, #p - 7, 8 do
        local b1, b2 = byte(p, j, j + 1)
        if expiry_of(p, j) > clock then rids[b1 * 256 + b2] = true end
      end
      parsed[p] = rids
    end
    predicted[k] = rids
  end
end
-- a whole segment every run still going holds (its counts per tier) or is predicted to; the
-- next segment with the same predictions and holders moves the same runs by the same counts
local last_rids, last_whole, last_moves = nil, nil, nil
local function skip_predicted(k)
  load_ends()
  local rids, held = predicted[k], {}
  local whole = ends[k] or ''
  if rids == last_rids and whole == last_whole then
    for _, m in ipairs(last_moves) do
      local run = m[1]
      run[1], run[2], run[3] = run[1] + S, run[2] + m[2], run[3] + m[3]
      run[4], run[5], run[6] = run[4] + m[4], run[5] + m[5], run[6] + m[6]
    end
    depth = depth + S
    return true
  end
  for j = 1, #whole - 1 - TB, 2 + TB do
    local b1, b2 = byte(whole, j, j + 1)
    held[b1 * 256 + b2] = j
  end
  local now = {}
  for _, rid in ipairs(order) do
    local run = runs[rid]
    if run[1] == depth then
      local j = held[rid]
      if j then
        local g, c, st, rm = byte(whole, j + 2, j + 5)
        now[#now + 1] = {run, g, c, st, rm, 0}
      elseif rids and rids[rid] then
        now[#now + 1] = {run, S, 0, 0, 0, S}
      else
        return false
      end
    end
  end
  if #now == 0 then return false end
  last_rids, last_whole, last_moves = rids, whole, now
  return skip_predicted(k)
end
while i <= last do
  local k = (i - 1) / (8 * S) + 1
  if depth > 0 and k == floor(k) and predicted[k] and skip_predicted(k) then
    i = i + 8 * S
  else
    last_rids = nil  -- the runs going on may change
    local f = sub(chain, i, i + 7)
    local moved = false
    local v = call('HGET', block_bucket(bprefix, f), f)
    if v then
      for j = 1, #v - 1, 2 do
        local b1, b2 = byte(v, j, j + 1)
        local t = b2 % M
        local run = run_of(b1 * R + (b2 - t) / M)
        if run and run[1] == depth then
          run[1] = depth + 1
          run[SLOT[t]] = run[SLOT[t]] + 1
          moved = true
        end
      end
    end
    local function extend(rid)  -- predicted: counts as GPU, unless real placements moved it
      local run = run_of(rid)
      if run and run[1] == depth then
        run[1], run[2], run[6] = depth + 1, run[2] + 1, run[6] + 1
        moved = true
      end
    end
    local p = call('HGET', block_bucket(pprefix, f), f)
    if p then
      clock = clock or now_ms()
      for j = 1, #p - 7, 8 do
        local b1, b2 = byte(p, j, j + 1)
        if expiry_of(p, j) > clock then extend(b1 * 256 + b2) end
      end
    end
    for rid in pairs(predicted[floor(k)] or {}) do extend(rid) end
    if not moved then break end
    depth = depth + 1
    i = i + 8
  end
end
local stats = redis.call('HGETALL', ARGV[1] .. ':stats')
local hprefix, n = ARGV[1] .. ':h:', #chain / 8
local homes, horder, block = {}, {}, 1
while block <= n do
  local f = string.sub(chain, block * 8 - 7, block * 8)
  local h = redis.call('HGET', block_bucket(hprefix, f), f)
  if not h or #h < 14 then break end
  clock = clock or now_ms()
  if expiry_of(h, 7) <= clock then break end
  local b1, b2 = string.byte(h, 1, 2)
  local rid = b1 * 256 + b2
  if not homes[rid] then horder[#horder + 1] = rid end
  homes[rid] = {block, clock - expiry_of(h, 1)}
  if block == n then break end
  block = math.min(block * 2, n)
end
local named = {}
if #horder > 0 then
  local hnames = redis.call('HMGET', KEYS[1], unpack(horder))
  for k, rid in ipairs(horder) do
    if hnames[k] then
      named[#named + 1] = hnames[k]
      named[#named + 1] = homes[rid][1]
      named[#named + 1] = homes[rid][2]
    end
  end
end
local session, lives = {}, {}
if #ARGV[6] == 8 then
  clock = clock or now_ms()
  local h = redis.call('HGET', block_bucket(hprefix, ARGV[6]), ARGV[6])
  if h and #h >= 14 and expiry_of(h, 7) > clock then
    local b1, b2 = string.byte(h, 1, 2)
    local name = redis.call('HGET', KEYS[1], b1 * 256 + b2)
    if name then session = {name, clock - expiry_of(h, 1)} end
  end
  local rn = redis.call('HGETALL', KEYS[1])
  for j = 1, #rn - 1, 2 do
    local live = ARGV[1] .. ':ss:' .. rn[j]
    local c = redis.call('ZCOUNT', live, '(' .. clock, '+inf')
    if c > 0 then
      local own = redis.call('ZSCORE', live, ARGV[6])
      if own and tonumber(own) > clock then c = c - 1 end
      if c > 0 then
        lives[#lives + 1] = rn[j + 1]
        lives[#lives + 1] = c
      end
    end
  end
end
local load = {}
if KEYS[2] then load = load_snapshot(KEYS[2], ARGV[4], tonumber(ARGV[5])) end
local ahead = redis.call('HGETALL', ARGV[1] .. ':lookahead')
if #order == 0 then return {{}, stats, named, load, ahead, session, lives} end
local names = redis.call('HMGET', KEYS[1], unpack(order))
local out = {}
for k, rid in ipairs(order) do
  if names[k] and runs[rid][1] > 0 then
    out[#out + 1] = names[k]
    for slot = 1, 6 do out[#out + 1] = runs[rid][slot] end
  end
end
return {out, stats, named, load, ahead, session, lives}
"""
)


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


# ----------------------------------------------------------- the routers

# The shared router load (tracker.core.keys: ``load``), for router.shared.redis_load: PUT writes one
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
# expired entries and its own older entry on the way): each segment of the prompt inside them
# as one entry (``ps:``), the others block by block (``p:``), so a long prompt costs a write
# per segment, not per block.
_ROUTED: Final = (
    BUCKETS
    + PREDICTIONS
    + _HASHTABLE
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
local function predict_blocks(pprefix, rid, mine, ttl, chain, clock, from, to)
  for i = from * 8 + 1, to * 8 - 7, 8 do
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
end
-- the whole segments ending at these keys, in one hash (one HMGET, one HSET per 1000)
local function predict_segments(prefix, rid, mine, ttl, ends, clock)
  local slot = math.floor((clock + ttl) / W)
  local key = prefix .. ':ps:' .. slot
  redis.call('HSETNX', key, '', HASHTABLE)
  for c = 1, #ends, 1000 do
    local part = {unpack(ends, c, math.min(c + 999, #ends))}
    local got = redis.call('HMGET', key, unpack(part))
    local args = {}
    for x, f in ipairs(part) do
      local out, v = {mine}, got[x]
      if v then
        for j = 1, #v - 7, 8 do
          local b1, b2 = string.byte(v, j, j + 1)
          if b1 * 256 + b2 ~= rid and expiry_of(v, j) > clock then
            out[#out + 1] = string.sub(v, j, j + 7)
          end
        end
      end
      args[#args + 1] = f
      args[#args + 1] = table.concat(out)
    end
    redis.call('HSET', key, unpack(args))
  end
  redis.call('PEXPIREAT', key, (slot + 1) * W)
end
-- chain: the blocks at positions first, first + 1, ... of a prompt; each segment [kS, kS + S)
-- inside it is predicted whole, the blocks before the first and after the last one by one
local function predict(prefix, rid, ttl, chain, clock, first, S)
  local n = #chain / 8
  if n == 0 then return 0 end
  local mine = string.char(math.floor(rid / 256), rid % 256) .. pack_expiry(clock + ttl)
  local lo = math.ceil(first / S) * S - first  -- chain indices of the whole segments: lo..hi-1
  local hi = math.floor((first + n) / S) * S - first
  if hi <= lo then lo, hi = n, n end
  local pprefix = prefix .. ':p:'
  predict_blocks(pprefix, rid, mine, ttl, chain, clock, 0, lo)
  predict_blocks(pprefix, rid, mine, ttl, chain, clock, hi, n)
  if hi > lo then
    local ends = {}
    for i = lo + S, hi, S do ends[#ends + 1] = string.sub(chain, i * 8 - 7, i * 8) end
    predict_segments(prefix, rid, mine, ttl, ends, clock)
  end
  local plive = prefix .. ':plive'
  if redis.call('PTTL', plive) < ttl then redis.call('SET', plive, '1', 'PX', ttl) end
  return n
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
# replica name, the first key's position in its chain, blocks per segment]. Returns the
# blocks predicted, or -1, writing nothing, when the rid no longer
# belongs to that replica (Redis lost data, or the rid was released and reused).
PREDICT: Final = (
    _ROUTED
    + """
local rid = tonumber(ARGV[2])
if redis.call('HGET', KEYS[1], rid) ~= ARGV[5] then return -1 end
return predict(ARGV[1], rid, tonumber(ARGV[3]), ARGV[4], now_ms(), tonumber(ARGV[6]),
  tonumber(ARGV[7]))
"""
)

# KEYS: [rname hash]; ARGV: [key prefix with hash tag, rid, replica name, prediction ttl ms,
# predicted block keys, home ttl ms, anchor block keys (8 bytes per key), the first predicted
# key's position in its chain, blocks per segment, the request's session key (8 bytes, or ''),
# the session's window ms]. PREDICT and CLAIM in one call: what a router writes after each
# request it routes. A session (also one of the anchors) joins the replica's live sessions
# (``ss:<rid>``, a sorted set scored by expiry, swept as it is written) and leaves the set of
# the replica its home named before. Returns 0, or -1, writing nothing, when the rid no longer
# belongs to that replica.
ROUTE: Final = (
    _ROUTED
    + """
local rid = tonumber(ARGV[2])
if redis.call('HGET', KEYS[1], rid) ~= ARGV[3] then return -1 end
local clock = now_ms()
local session, before = ARGV[10], nil
if #session == 8 then
  before = redis.call('HGET', block_bucket(ARGV[1] .. ':h:', session), session)
end
predict(ARGV[1], rid, tonumber(ARGV[4]), ARGV[5], clock, tonumber(ARGV[8]), tonumber(ARGV[9]))
claim(ARGV[1] .. ':h:', rid, tonumber(ARGV[6]), ARGV[7], clock)
if #session == 8 then
  if before and #before >= 14 then
    local b1, b2 = string.byte(before, 1, 2)
    local was = b1 * 256 + b2
    if was ~= rid then redis.call('ZREM', ARGV[1] .. ':ss:' .. was, session) end
  end
  local live, window = ARGV[1] .. ':ss:' .. rid, tonumber(ARGV[11])
  redis.call('ZADD', live, clock + window, session)
  redis.call('ZREMRANGEBYSCORE', live, '-inf', clock)
  if redis.call('PTTL', live) < window then redis.call('PEXPIRE', live, window) end
end
return 0
"""
)


# ----------------------------------------------------------- the tracker election

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
