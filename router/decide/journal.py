"""The decision journal: every routing decision as one JSON line, for tracing a policy.

``kvrouter router --decision-log FILE`` appends, per request, what the policy saw and what it
made of it: each candidate's cached run (real, predicted, offload), its load and engine
gauges, its score breakdown, and the choice. Lines are written as they happen (a write per
request, small and buffered by the OS); for benchmarks and investigations, not for a router
under production load.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from router.decide.policy_types import Decision, ReplicaState
from tracker.core.index import Match

_encode = msgspec.json.Encoder().encode


class DecisionJournal:
    """Appends decisions to ``path`` (opened at construction, closed by :meth:`close`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[bytes] | None = self.path.open("ab", buffering=0)

    def record(
        self,
        *,
        model: str,
        prompt_tokens: int,
        keys: Sequence[int],
        matches: dict[str, Match],
        states: Sequence[ReplicaState],
        decision: Decision,
        fallback: str | None,
        session: str | None = None,
        stages: dict[str, float] | None = None,
    ) -> None:
        if self._file is None:
            return
        candidates: dict[str, Any] = {}
        for state, score in zip(states, decision.scores, strict=True):
            match = matches.get(state.id)
            candidates[state.id] = {
                "matched": match.blocks if match else 0,
                "gpu": match.gpu_blocks if match else 0,
                "offload": match.offload_blocks if match else 0,
                "predicted": match.predicted_blocks if match else 0,
                "inflight": state.inflight,
                "recent_inflight": round(state.recent_inflight, 2),
                "queued_tokens": state.queued_prefill_tokens,
                "engine_waiting": state.engine_waiting,
                "engine_running": state.engine_running,
                "kv_usage": state.kv_usage,
                "queue_ms": round(score.queue_ms, 3),
                "prefill_ms": round(score.prefill_ms, 3),
                "ttft_ms": round(score.expected_ttft_ms, 3),
                "score": round(score.score, 3),
                "compute_ms": round(score.compute_ms, 3),
                "evict_ms": round(score.evict_ms, 3),
                "split_tokens": round(score.split_tokens, 1),
                "regret": round(score.regret, 3),
                "resident": state.resident_blocks,
                "valued": state.valued_blocks,
                "cache_blocks": state.cache_blocks,
                "churn": None if state.churn is None else round(state.churn, 3),
                "home": round(state.home_blocks, 1),
                "session_home": state.session_home,
                "sessions": state.sessions,
            }
        line = {
            "t": round(time.time(), 4),
            "model": model,
            "prompt_tokens": prompt_tokens,
            "blocks": len(keys),
            # prompts sharing a first block share a prefix: enough to follow a group
            "first_key": f"{keys[0]:016x}" if keys else None,
            "chosen": decision.replica,
            "fallback": fallback,
            "session": session,
            # real milliseconds per stage of the decision (tokenize, hash, lookup, score, total)
            "stages_ms": {k: round(v * 1000, 3) for k, v in (stages or {}).items()},
            "candidates": candidates,
        }
        self._file.write(_encode(line) + b"\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
