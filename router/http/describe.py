"""The operator routes' JSON bodies: a placement as ``POST /index`` answers it (where the
prompt is cached, and where it would go), a replica as ``GET /replicas`` lists it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from router.decide.placement import Placement
from router.decide.policy_types import SpeedEstimate
from router.fleet.replicas import Replica
from tracker.core.index import describe_match


def describe_placement(placement: Placement) -> dict[str, Any]:
    """Where a prompt is cached and where it would go, as ``POST /index`` answers it."""
    size = placement.namespace.block_size
    replicas = {
        m.replica: {**describe_match(m, size), "predicted_blocks": m.predicted_blocks}
        for m in sorted(placement.matches.values(), key=lambda m: (-m.blocks, m.replica))
    }
    decision = placement.decision
    return {
        "model": placement.model,
        "block_size": size,
        "prompt_tokens": placement.prompt_tokens,
        "blocks": len(placement.keys),
        "fallback": placement.fallback,
        "replicas": replicas,
        "homes": {
            replica: {"blocks": home.blocks, "age_s": round(home.age_s, 3)}
            for replica, home in sorted(placement.homes.items())
        },
        "decision": {
            "replica": decision.replica,
            "mode": decision.mode,
            "scores": [asdict(s) for s in sorted(decision.scores, key=lambda s: -s.score)],
        },
        "stages_ms": {k: round(v * 1000, 4) for k, v in placement.stages.items()},
    }


def describe_replica(
    replica: Replica, load: Any, speed: SpeedEstimate, now: float
) -> dict[str, Any]:
    """One replica as ``GET /replicas`` lists it: its state, ``load`` (a
    :class:`~router.shared.load.Load` or None) and ``speed``, engine gauges aged from ``now``."""
    engine = replica.engine
    return {
        "id": replica.id,
        "url": replica.url,
        "model": replica.model,
        "block_size": replica.block_size,
        "source": "static" if replica.static else "registry",
        "healthy": replica.healthy,
        "failures": replica.failures,
        "last_error": replica.last_error or None,
        "inflight": load.inflight if load else 0,
        "queued_prefill_tokens": load.queued_prefill_tokens if load else 0,
        "engine": None
        if engine is None
        else {
            "running": engine.running,
            "waiting": engine.waiting,
            "kv_usage": engine.kv_usage,
            "age_s": round(now - engine.at, 3),
        },
        "speed": {
            "floor_ms": round(speed.floor_ms, 3),
            "prefill_ms_per_token": round(speed.prefill_ms_per_token, 6),
        },
    }
