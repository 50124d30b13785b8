"""Lua snippets the index's server-side scripts share: bucket names, entry layout, clocks.

Bucket key names are built in Lua from the partition's key prefix with the layout of
:mod:`tracker.core.keys`; block-bucket values are strings of 2-byte entries, one per replica:
``rid << 4 | tiers`` (``tiers`` bits: GPU, CPU, storage, remote;
:class:`tracker.core.ledger.Tier`). Prediction and home records carry Redis server time.
"""

from __future__ import annotations

from typing import Final

from tracker.core.keys import BLOCK_BUCKET_BITS, ENGINE_BUCKETS, ENGINE_VALUE_BYTES, TIER_BITS

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


# The entry layout of block buckets: rid in the high bits (R rids per high byte), tiers in the
# low TIER_BITS (M values); engine-map values are E bytes; SLOT[tiers] is where a lookup run
# counts a block (2 GPU, 3 CPU, 4 storage, 5 remote: the cheapest tier it is in).
LAYOUT: Final = (
    f"local R, M, E = {1 << (8 - TIER_BITS)}, {1 << TIER_BITS}, {ENGINE_VALUE_BYTES}\n"
    + "local SLOT = {"
    + ", ".join(f"[{t}] = {_slot(t)}" for t in range(1, 1 << TIER_BITS))
    + "}\n"
)

# Prediction buckets (``p:``) hold, per block key, 8-byte entries: rid (2 bytes) + expiry in
# Redis server time (6 bytes, ms). The router writes them after routing (predict-on-route).
PREDICTIONS: Final = """
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
