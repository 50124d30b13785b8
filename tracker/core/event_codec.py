"""Msgpack codec of :class:`~tracker.core.events.EventBatch` payloads for every wire era.

Decoding is version-agnostic and strict about types; encoding reproduces a chosen era's
bytes exactly, so the simulated engine is indistinguishable from vLLM on the wire. Pure, no I/O.
"""

from __future__ import annotations

import enum
from array import array
from typing import Any, Final

import msgspec

from tracker.core.events import (
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    ExternalHash,
    UnknownEvent,
)
from tracker.framework.errors import DecodeError


class WireEra(enum.Enum):
    """Wire layouts, named by the first vLLM release that emits each one.

    * the payload is msgpack of ``EventBatch`` = ``[ts, events, data_parallel_rank]`` (no rank
      before vLLM v0.9.1);
    * each event is a tagged positional array (vLLM v0.9 - v0.23, SGLang) or a map with a
      ``type`` key whose default-valued optional fields are omitted (vLLM v0.24+);
    * vLLM v0.26 adds ``locality``, ``ownership`` and ``session_id`` to ``BlockStored``
      (``locality`` and ``ownership`` to ``BlockRemoved``), ``medium`` may be ``"STORAGE"``,
      and each block's ``extra_keys`` start with the LoRA name; v0.33 adds
      ``lookahead_token_ids``.
    """

    V0_9_0 = "v0.9.0"
    V0_9_1 = "v0.9.1"
    V0_10_2 = "v0.10.2"
    V0_14_0 = "v0.14.0"
    V0_17_0 = "v0.17.0"
    V0_20_0 = "v0.20.0"
    V0_22_0 = "v0.22.0"
    V0_24_0 = "v0.24.0"
    V0_26_0 = "v0.26.0"
    V0_33_0 = "v0.33.0"

    @classmethod
    def for_release(cls, release: str) -> WireEra:
        """The era a vLLM release tag (``v0.11.0``, ``0.25.1``) emits."""
        wanted = _version_tuple(release)
        chosen = cls.V0_9_0
        for era in cls:
            if _version_tuple(era.value) <= wanted:
                chosen = era
        return chosen

    def at_least(self, other: WireEra) -> bool:
        """Whether this era is ``other`` or a later one."""
        return _ERA_ORDER[self] >= _ERA_ORDER[other]

    @property
    def map_events(self) -> bool:
        return self.at_least(WireEra.V0_24_0)

    @property
    def has_rank(self) -> bool:
        return self is not WireEra.V0_9_0


def _version_tuple(release: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in release.lstrip("v").split(".")[:3])
    except ValueError as exc:
        raise ValueError(f"not a vLLM release tag: {release!r}") from exc


# Field names of each struct in declaration order, and the first era carrying each field.
_STORED_FIELDS: Final = (
    ("block_hashes", WireEra.V0_9_0),
    ("parent_block_hash", WireEra.V0_9_0),
    ("token_ids", WireEra.V0_9_0),
    ("block_size", WireEra.V0_9_0),
    ("lora_id", WireEra.V0_9_0),
    ("medium", WireEra.V0_10_2),
    ("lora_name", WireEra.V0_14_0),
    ("extra_keys", WireEra.V0_17_0),
    ("group_idx", WireEra.V0_20_0),
    ("kv_cache_spec_kind", WireEra.V0_22_0),
    ("kv_cache_spec_sliding_window", WireEra.V0_22_0),
    ("locality", WireEra.V0_26_0),
    ("ownership", WireEra.V0_26_0),
    ("session_id", WireEra.V0_26_0),
    ("lookahead_token_ids", WireEra.V0_33_0),
)
_REMOVED_FIELDS: Final = (
    ("block_hashes", WireEra.V0_9_0),
    ("medium", WireEra.V0_10_2),
    ("group_idx", WireEra.V0_20_0),
    ("locality", WireEra.V0_26_0),
    ("ownership", WireEra.V0_26_0),
)
# Fields vLLM declares with a default; map-era encoding omits them when equal to it.
_OMITTABLE: Final = frozenset(
    {
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    }
)
_ERA_ORDER: Final = {era: i for i, era in enumerate(WireEra)}
NEWEST_ERA: Final = list(WireEra)[-1]

_encoder = msgspec.msgpack.Encoder()


def _fields_for(fields: tuple[tuple[str, WireEra], ...], era: WireEra) -> list[str]:
    return [name for name, since in fields if _ERA_ORDER[since] <= _ERA_ORDER[era]]


def _encode_event(event: Event, era: WireEra) -> Any:
    if isinstance(event, BlockStored):
        tag, names = "BlockStored", _fields_for(_STORED_FIELDS, era)
    elif isinstance(event, BlockRemoved):
        tag, names = "BlockRemoved", _fields_for(_REMOVED_FIELDS, era)
    elif isinstance(event, AllBlocksCleared):
        tag, names = "AllBlocksCleared", []
    else:
        raise TypeError(f"cannot encode {type(event).__name__}")
    if era.map_events:
        out: dict[str, Any] = {"type": tag}
        for name in names:
            value = getattr(event, name)
            if value is None and name in _OMITTABLE:
                continue
            out[name] = value
        if len(names) + 1 > _FIXMAP_MAX:
            return _map16(out)
        return out
    return [tag, *(getattr(event, name) for name in names)]


_FIXMAP_MAX: Final = 15


def _map16(entries: dict[str, Any]) -> msgspec.Raw:
    """``entries`` behind a map16 header, as msgspec writes a struct of more than 15 fields.

    msgspec sizes a struct's map header by the fields it *may* write (v0.33's
    ``BlockStored`` has 16 with its tag), then omits the defaults: the header stays map16.
    """
    body = b"".join(_encoder.encode(k) + _encoder.encode(v) for k, v in entries.items())
    return msgspec.Raw(b"\xde" + len(entries).to_bytes(2, "big") + body)


def encode_batch(batch: EventBatch, era: WireEra) -> bytes:
    """Msgpack payload of ``batch`` exactly as vLLM's release ``era`` encodes it."""
    events = [_encode_event(event, era) for event in batch.events]
    body: list[Any] = [float(batch.ts), events]
    if era.has_rank:
        body.append(batch.data_parallel_rank)
    return _encoder.encode(body)


# ---------------------------------------------------------------- decoding


def _check_hash(value: Any, what: str) -> ExternalHash:
    if isinstance(value, bool):
        raise DecodeError("bad_hash", f"{what}: bool")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= U64_MASK:
            raise DecodeError("bad_hash", f"{what}: {value} out of 64-bit range")
        return value
    if isinstance(value, bytes) and value:
        return value
    raise DecodeError("bad_hash", f"{what}: {type(value).__name__}")


def _check_hashes(value: Any) -> list[ExternalHash]:
    if not isinstance(value, list) or not value:
        raise DecodeError("bad_event", "block_hashes must be a non-empty array")
    return [_check_hash(h, "block_hashes") for h in value]


def _opt(value: Any, kind: type, name: str) -> Any:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise DecodeError("bad_event", f"{name}: expected {kind.__name__} or nil")


def _check_tokens(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise DecodeError("bad_event", "token_ids must be an array")
    try:
        array("I", value)  # C-speed check: every id is an int in [0, 2**32)
    except (TypeError, OverflowError) as exc:
        raise DecodeError("bad_event", f"token_ids: {exc}") from None
    return value


def _check_lookahead(value: Any) -> list[list[int] | None] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise DecodeError("bad_event", "lookahead_token_ids must be an array or nil")
    return [None if tokens is None else _check_tokens(tokens) for tokens in value]


def _stored(fields: dict[str, Any]) -> BlockStored:
    block_size = fields.get("block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
        raise DecodeError("bad_event", "block_size must be a non-negative int")
    parent = fields.get("parent_block_hash")
    lora_name = fields.get("lora_name")
    if isinstance(lora_name, dict):
        # SGLang >= 0.5.18 puts a metadata map where vLLM has lora_name.
        lora_name = None
    extra = fields.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise DecodeError("bad_event", "extra_keys must be an array or nil")
    return BlockStored(
        block_hashes=_check_hashes(fields.get("block_hashes")),
        parent_block_hash=None if parent is None else _check_hash(parent, "parent"),
        token_ids=_check_tokens(fields.get("token_ids")),
        block_size=block_size,
        lora_id=_opt(fields.get("lora_id"), int, "lora_id"),
        medium=_opt(fields.get("medium"), str, "medium"),
        lora_name=_opt(lora_name, str, "lora_name"),
        extra_keys=extra,
        group_idx=_opt(fields.get("group_idx"), int, "group_idx"),
        kv_cache_spec_kind=_opt(fields.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt(
            fields.get("kv_cache_spec_sliding_window"), int, "kv_cache_spec_sliding_window"
        ),
        locality=_opt(fields.get("locality"), str, "locality"),
        ownership=_opt(fields.get("ownership"), str, "ownership"),
        session_id=_opt(fields.get("session_id"), str, "session_id"),
        lookahead_token_ids=_check_lookahead(fields.get("lookahead_token_ids")),
    )


def _removed(fields: dict[str, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_check_hashes(fields.get("block_hashes")),
        medium=_opt(fields.get("medium"), str, "medium"),
        group_idx=_opt(fields.get("group_idx"), int, "group_idx"),
        locality=_opt(fields.get("locality"), str, "locality"),
        ownership=_opt(fields.get("ownership"), str, "ownership"),
    )


# Positional events stopped growing when vLLM v0.24 switched to maps: later fields are map-only.
_STORED_NAMES: Final = _fields_for(_STORED_FIELDS, WireEra.V0_22_0)
_REMOVED_NAMES: Final = _fields_for(_REMOVED_FIELDS, WireEra.V0_22_0)
_REQUIRED: Final = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


def _decode_event(raw: Any) -> Event:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise DecodeError("bad_event", "array event without a string tag")
        tag, values = raw[0], raw[1:]
        names = _STORED_NAMES if tag == "BlockStored" else _REMOVED_NAMES
        if tag in _REQUIRED and len(values) < _REQUIRED[tag]:
            raise DecodeError("bad_event", f"{tag} has {len(values)} fields")
        fields = dict(zip(names, values, strict=False))
    elif isinstance(raw, dict):
        map_tag = raw.get("type")
        if not isinstance(map_tag, str):
            raise DecodeError("bad_event", "map event without a string 'type'")
        tag, fields = map_tag, raw
        if tag == "BlockStored" and not {"block_hashes", "token_ids", "block_size"} <= raw.keys():
            raise DecodeError("bad_event", "BlockStored map lacks required keys")
    else:
        raise DecodeError("bad_event", f"event is a {type(raw).__name__}")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return UnknownEvent(tag=tag)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack ``EventBatch`` of any era; raises :class:`DecodeError`."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:
        raise DecodeError("msgpack", str(exc)) from None
    if isinstance(raw, dict):  # a fully map-encoded batch, seen in one unreleased vLLM revision
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise DecodeError("bad_batch", "EventBatch must be an array of at least 2 items")
    ts, events = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise DecodeError("bad_batch", "ts must be a number")
    if not isinstance(events, list):
        raise DecodeError("bad_batch", "events must be an array")
    rank = raw[2] if len(raw) > 2 else None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DecodeError("bad_batch", "data_parallel_rank must be an int or nil")
    return EventBatch(float(ts), [_decode_event(e) for e in events], rank)


# Array-era field counts (after the tag) and the first era carrying each count.
_ARRAY_ERAS: Final = {
    "BlockStored": {
        len(_fields_for(_STORED_FIELDS, era)): era
        for era in reversed(WireEra)
        if not era.map_events
    },
    "BlockRemoved": {
        len(_fields_for(_REMOVED_FIELDS, era)): era
        for era in reversed(WireEra)
        if not era.map_events
    },
}
_MAP_ERA_KEYS: Final = tuple(
    (era, frozenset(name for name, since in _STORED_FIELDS + _REMOVED_FIELDS if since is era))
    for era in reversed(WireEra)
    if _ERA_ORDER[era] > _ERA_ORDER[WireEra.V0_24_0]
)


def wire_era(payload: bytes) -> WireEra | None:
    """The oldest vLLM wire era that can have produced ``payload``; None if undecodable.

    A lower bound: newer engines omit default-valued fields, so a v0.33 batch without
    lookahead tokens reads as v0.26 or v0.24. Decoding never needs it (it accepts every era);
    the tracker reports it so an operator sees what each engine speaks.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        return None
    era = WireEra.V0_9_0 if len(raw) == 2 else WireEra.V0_9_1
    for event in raw[1]:
        found: WireEra | None = None
        if isinstance(event, dict):
            found = WireEra.V0_24_0
            for newer, keys in _MAP_ERA_KEYS:
                if not keys.isdisjoint(event):
                    found = newer
                    break
        elif isinstance(event, list) and event and isinstance(event[0], str):
            found = _ARRAY_ERAS.get(event[0], {}).get(len(event) - 1)
        if found is not None and _ERA_ORDER[found] > _ERA_ORDER[era]:
            era = found
    return era
