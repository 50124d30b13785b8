"""vLLM's block hashes: the ``sha256`` chain over a request's full blocks, and its tokens.

Mirrors ``vllm/v1/core/kv_cache_utils.py``: full blocks are keyed by ``h_i =
sha256(pickle((h_{i-1} or NONE_HASH, tokens_i, extra_i)))`` with ``NONE_HASH =
sha256(pickle(hash_seed))``; events carry the low 64 bits of each digest (these are not
kvrouter's own ``tracker.core.blocks`` keys). :class:`TokenSequence` holds a request's token
ids and the digests of its full blocks.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any


def sha256_digest(value: object) -> bytes:
    """vLLM's ``sha256`` hash function: SHA-256 of the highest-protocol pickle."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(hash_seed: str) -> bytes:
    """Parent of every first block, as vLLM derives it from ``PYTHONHASHSEED``."""
    return sha256_digest(hash_seed)


def external_hash(digest: bytes) -> int:
    """The event form of a digest: its low 64 bits as an unsigned int."""
    return int.from_bytes(digest[-8:], "big")


class TokenSequence:
    """A request's token ids and the chained digests of its full blocks.

    Args:
        prompt: prompt token ids.
        block_size: tokens per block.
        root: ``NONE_HASH`` of the engine (see :func:`none_hash`).
        lora_name: LoRA adapter; part of every block's extra keys.
        lora_id: the adapter's engine-local integer id (``BlockStored.lora_id``).
        cache_salt: part of the first block's extra keys.
        lookahead: tokens after each block folded into its hash (vLLM 0.33's lookahead
            hashing); a block is hashed once that many tokens follow it.
    """

    __slots__ = (
        "block_hashes",
        "block_size",
        "cache_salt",
        "lookahead",
        "lora_id",
        "lora_name",
        "root",
        "token_ids",
    )

    def __init__(
        self,
        prompt: Sequence[int],
        *,
        block_size: int,
        root: bytes,
        lora_name: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        lookahead: int = 0,
    ) -> None:
        self.block_size = block_size
        self.lookahead = lookahead
        self.root = root
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.cache_salt = cache_salt
        self.token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.extend(prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def extra_keys(self, index: int) -> tuple[Any, ...] | None:
        """Extra hash inputs of block ``index``: LoRA name, then the cache salt on block 0."""
        keys: list[Any] = [] if self.lora_name is None else [self.lora_name]
        if index == 0 and self.cache_salt is not None:
            keys.append(self.cache_salt)
        return tuple(keys) if keys else None

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens and hash the blocks they complete (and follow by ``lookahead``)."""
        self.token_ids.extend(tokens)
        size, ahead = self.block_size, self.lookahead
        for i in range(len(self.block_hashes), max(0, len(self.token_ids) - ahead) // size):
            parent = self.block_hashes[i - 1] if i else self.root
            chunk = tuple(self.token_ids[i * size : (i + 1) * size + ahead])
            self.block_hashes.append(sha256_digest((parent, chunk, self.extra_keys(i))))

    def lookahead_ids(self, index: int) -> list[int]:
        """The tokens after block ``index`` that its hash covers."""
        end = (index + 1) * self.block_size
        return self.token_ids[end : end + self.lookahead]
