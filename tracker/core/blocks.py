"""kvrouter's own chained 64-bit block keys, computed from token ids; pure and fast.

The tracker computes the chain from ``BlockStored.token_ids``, the router the same chain from
a request's tokens, so the index never relies on vLLM's hashes (which depend on
``PYTHONHASHSEED``, the hash algorithm and the release). The chain: :func:`block_keys`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

import msgspec
import xxhash

SCHEME_VERSION: Final = 1
_xxh3 = xxhash.xxh3_64_intdigest
_pack = msgspec.msgpack.Encoder().encode


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a block key depends on besides tokens: model, LoRA adapter and block size."""

    model: str
    block_size: int
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def seed(self) -> int:
        return namespace_seed(self.model, self.lora_name, self.block_size)

    def base(self) -> Namespace:
        """The index partition this namespace lives in (LoRA is folded into the keys)."""
        return self if self.lora_name is None else Namespace(self.model, self.block_size)


@lru_cache(maxsize=1024)
def namespace_seed(model: str, lora_name: str | None, block_size: int) -> int:
    """Root seed of every key chain in a namespace."""
    return _xxh3(_pack(["kvrouter-blocks", SCHEME_VERSION, model, lora_name or "", block_size]))


def session_key(namespace: Namespace, session: str) -> int:
    """The 64-bit key a session's home is recorded under (``prompt_cache_key`` or a session
    header): in the namespace's partition beside the block keys, never equal to one in
    practice (a different hash input), and the same for every router."""
    return _xxh3(_pack(["kvrouter-session", SCHEME_VERSION, session]), seed=namespace.seed)


def own_extra_keys(lora_name: str | None, extra_keys: Sequence[Any] | None) -> list[Any] | None:
    """An engine's per-block ``extra_keys`` as the key function takes them, for every era.

    From vLLM v0.26 each block's extra keys start with the LoRA name; before, they held only
    the multimodal and cache-salt inputs. The LoRA name is already in the namespace seed, so
    it is dropped here and a v0.25 and a v0.33 engine give the same prompt the same keys — the
    ones a router computes from ``Namespace(model, B, lora)`` and the cache salt alone. (A
    pre-v0.26 block whose only extra key is a cache salt equal to the adapter's name would be
    read as v0.26: the one ambiguity, harmless unless salts are named after adapters.)
    """
    if lora_name is None or not extra_keys:
        return None if not extra_keys else list(extra_keys)
    if not all(isinstance(e, list | tuple) and e and e[0] == lora_name for e in extra_keys):
        return list(extra_keys)
    return [tuple(e[1:]) or None for e in extra_keys]


def token_bytes(tokens: Sequence[int] | array[int]) -> bytes:
    """Token ids as packed little-endian uint32, the form the key function hashes."""
    packed = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        raise RuntimeError("array('I') is not 32-bit on this platform")
    data = packed.tobytes()
    return data if _LITTLE_ENDIAN else _swap(packed)


def _swap(packed: array[int]) -> bytes:  # pragma: no cover - big-endian hosts only
    copy = array("I", packed)
    copy.byteswap()
    return copy.tobytes()


_LITTLE_ENDIAN: Final = array("I", [1]).tobytes()[0] == 1


def block_keys(
    tokens: Sequence[int] | array[int] | bytes,
    namespace: Namespace,
    *,
    parent: int | None = None,
    extra_keys: Sequence[Any] | None = None,
    limit: int | None = None,
    lookahead: int = 0,
) -> list[int]:
    """Keys of every full block of ``tokens``, chained from ``parent`` (or the namespace root).

    For block ``i`` of a token sequence::

        key_0 = XXH3_64(tokens[0:B] as uint32 LE [+ msgpack(extra_0)], seed=namespace_seed)
        key_i = XXH3_64(tokens[iB:(i+1)B] as uint32 LE [+ msgpack(extra_i)], seed=key_{i-1})

    where ``namespace_seed = XXH3_64(msgpack(["kvrouter-blocks", 1, model, lora_name, B]))``.
    The token bytes have a fixed length (``4 * B``), so appending the extra keys is
    unambiguous. Only full blocks get keys, as in vLLM. Lookahead hashing (vLLM 0.33 with
    EAGLE-style drafting: ``BlockStored.lookahead_token_ids``) folds the ``L`` tokens after
    each block into its hash, so a block only hits for a request whose tokens go on the same
    way: block ``i`` hashes ``tokens[iB:(i+1)B + L]`` (still a fixed length,
    ``4 * (B + L)``), and only blocks followed by ``L`` tokens get keys.

    Args:
        tokens: token ids, or their :func:`token_bytes` form (cheaper when already packed).
        namespace: model / LoRA / block size the keys belong to.
        parent: key of the block preceding ``tokens[0]``; ``None`` when they start a sequence.
        extra_keys: one entry per block (``None`` or a tuple of extra hash inputs, e.g. a
            ``cache_salt`` on the first block), as in vLLM's ``BlockStored.extra_keys``.
        limit: hash at most this many blocks.
        lookahead: tokens after each block that its key covers (above); a block
            without that many tokens after it gets no key.
    """
    data = tokens if isinstance(tokens, bytes) else token_bytes(tokens)
    stride = namespace.block_size * 4
    ahead = max(0, lookahead) * 4
    count = max(0, len(data) - ahead) // stride
    if limit is not None:
        count = min(count, limit)
    key = namespace.seed if parent is None else parent
    keys: list[int] = []
    append = keys.append
    if not extra_keys or all(e is None for e in extra_keys):
        # Slicing bytes (a small copy) is cheaper than slicing a memoryview (a new view).
        for start in range(0, count * stride, stride):
            key = _xxh3(data[start : start + stride + ahead], key)
            append(key)
        return keys
    for i in range(count):
        extra = extra_keys[i] if i < len(extra_keys) else None
        chunk = data[i * stride : (i + 1) * stride + ahead]
        key = _xxh3(chunk if extra is None else chunk + _pack(extra), key)
        append(key)
    return keys


class ChainCache:
    """:func:`block_keys` for a router that sees the same long prefixes again and again.

    A 100k-token prompt is ~6,400 blocks: hashing them is ~1.2 ms of every decision, though
    most requests repeat an earlier prompt's prefix (a system prompt, a conversation so far)
    and add a little. The cache keeps recent prompts' token bytes and keys, found by
    (namespace, first block's key); when a prompt starts like one of them, it reuses the keys
    of the blocks whose bytes are equal to the longest-matching one's (compared, not assumed
    from a hash) and hashes the rest. The keys are a pure function of the bytes, so they are
    the ones :func:`block_keys` gives.

    Up to ``per_start`` prompts are kept per first block: conversations and agent sessions
    interleave, and they share their first blocks (the chat template, a tool preamble), so
    one entry per first block held only the last prompt seen and a session's next turn
    matched another session's preamble. A prompt replaces the one it extends whole (a
    conversation's next turn), and is kept beside the others. Bounded by the blocks it holds
    (``max_blocks``, least recently used out first); prompts shorter than ``min_blocks`` or
    with per-block extra keys are hashed in full.
    """

    def __init__(self, max_blocks: int = 131_072, min_blocks: int = 64, per_start: int = 16):
        if max_blocks < 0 or min_blocks < 1 or per_start < 1:
            raise ValueError("need max_blocks >= 0, min_blocks >= 1 and per_start >= 1")
        self.max_blocks = max_blocks
        self.min_blocks = min_blocks
        self.per_start = per_start
        self.blocks = 0
        self.reused = 0
        """Blocks whose keys came from the cache (a counter, for tests and metrics)."""
        self._serial = 0
        # serial -> (bytes, keys, start), least recently used first; a start is (namespace,
        # first block's key), and its serials are kept least recently used first too
        self._entries: dict[int, tuple[bytes, list[int], tuple[Namespace, int]]] = {}
        self._starts: dict[tuple[Namespace, int], list[int]] = {}

    def keys(
        self,
        tokens: Sequence[int] | array[int] | bytes,
        namespace: Namespace,
        *,
        extra_keys: Sequence[Any] | None = None,
        lookahead: int = 0,
    ) -> list[int]:
        """The keys :func:`block_keys` gives for ``tokens`` (chained from the root); with
        ``lookahead`` a block's key depends on the next block's tokens too, so they are
        hashed in full."""
        data = tokens if isinstance(tokens, bytes) else token_bytes(tokens)
        stride = namespace.block_size * 4
        count = len(data) // stride
        if count < self.min_blocks or self.max_blocks < count or extra_keys or lookahead:
            return block_keys(data, namespace, extra_keys=extra_keys, lookahead=lookahead)
        if len(data) != count * stride:
            data = data[: count * stride]
        start = (namespace, _xxh3(data[:stride], namespace.seed))
        # The candidate sharing the most whole windows (the most recent on a tie), then the
        # exact count of blocks inside its first window that differs.
        best, equal = -1, -1
        entries = self._entries
        for serial in reversed(self._starts.get(start, ())):
            windows = _equal_windows(entries[serial][0], data, stride)
            if windows > equal:
                best, equal = serial, windows
        keys: list[int] = []
        same = 0
        if best >= 0:
            old, old_keys, _ = entries[best]
            same = _same_blocks(old, data, stride, equal)
            keys = old_keys[:same]
            self.reused += same
            if same == len(old_keys):  # the new prompt extends it whole: it takes its place
                self._drop(best)
            else:  # another prompt on a shared prefix: the older one is still used
                entries[best] = entries.pop(best)
                serials = self._starts[start]
                serials.remove(best)
                serials.append(best)
        keys += block_keys(data[same * stride :], namespace, parent=keys[-1] if keys else None)
        self._serial += 1
        serials = self._starts.setdefault(start, [])
        serials.append(self._serial)
        entries[self._serial] = (data, keys, start)
        self.blocks += count
        if len(serials) > self.per_start:
            self._drop(serials[0])
        while self.blocks > self.max_blocks:
            self._drop(next(iter(entries)))
        return keys.copy()  # the caller's to keep or change; the cache keeps its own

    def _drop(self, serial: int) -> None:
        _, dropped, start = self._entries.pop(serial)
        self.blocks -= len(dropped)
        serials = self._starts[start]
        serials.remove(serial)
        if not serials:
            del self._starts[start]


_COMPARE_BLOCKS: Final = 256
"""Blocks compared per slice in :func:`_same_blocks` (16 KB at 16 tokens per block)."""


def _equal_windows(a: bytes, b: bytes, stride: int) -> int:
    """Bytes of the leading windows of :data:`_COMPARE_BLOCKS` blocks that ``a`` and ``b``
    have equal (the last window may be short: both end there)."""
    end = min(len(a), len(b)) // stride * stride
    window = stride * _COMPARE_BLOCKS
    start = 0
    while start < end:
        stop = min(start + window, end)
        if a[start:stop] != b[start:stop]:
            break
        start = stop
    return start


def _same_blocks(a: bytes, b: bytes, stride: int, start: int) -> int:
    """How many leading blocks of ``stride`` bytes ``a`` and ``b`` have in common, given
    ``start``, the bytes of their equal leading windows (:func:`_equal_windows`): a binary
    search inside the first window that differs (slice comparisons are memcmp; the slices'
    copies stay small)."""
    end = min(len(a), len(b)) // stride * stride
    if start >= end:
        return end // stride
    stop = min(start + stride * _COMPARE_BLOCKS, end)
    equal, differ = start // stride, stop // stride  # blocks: the first `equal` match
    while differ - equal > 1:
        mid = (equal + differ) // 2
        if a[start : mid * stride] == b[start : mid * stride]:
            equal = mid
        else:
            differ = mid
    return equal
