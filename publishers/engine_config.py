"""The simulated engine's config: its shape and speed, and what else it serves with."""

from __future__ import annotations

from dataclasses import dataclass

from publishers.config import EngineShape

__all__ = ["EngineConfig"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineShape):
    """Shape and speed of a simulated engine (:class:`~publishers.config.EngineShape`), and
    what else it serves with.

    Attributes:
        model: served model name (informational).
        hash_seed: the ``PYTHONHASHSEED`` string the block-hash chain is seeded with.
        data_parallel_rank: rank of this engine (informational; the publisher stamps it).
        lookahead_tokens: tokens after each block folded into its hash, as vLLM 0.33 does
            with EAGLE-style drafting (``BlockStored.lookahead_token_ids``).
        max_model_len: longest prompt + output; a request reaching it finishes with
            "length" (default and upper bound: the cache capacity, as vLLM requires).
        offload_blocks: blocks of a CPU tier behind the GPU cache, as vLLM's offloading
            connector keeps (0: none); see :class:`publishers.cache.OffloadTier`.
        offload_ms_per_token: time to load one token's KV back from the CPU tier (Llama-8B's
            128 KiB per token over a ~50 GB/s host link: 0.003 ms, a tenth of recomputing it).
    """

    model: str = "default"
    hash_seed: str = "0"
    data_parallel_rank: int = 0
    max_model_len: int | None = None
    lookahead_tokens: int = 0
    offload_blocks: int = 0
    offload_ms_per_token: float = 0.003

    def __post_init__(self) -> None:
        if self.lookahead_tokens < 0:
            raise ValueError("lookahead_tokens must be >= 0")
        if self.offload_blocks < 0 or not self.offload_ms_per_token >= 0:
            raise ValueError("offload_blocks and offload_ms_per_token must be >= 0")
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        capacity = self.num_blocks * self.block_size
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", capacity)
        elif not 0 < self.max_model_len <= capacity:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the cache ({capacity})")
