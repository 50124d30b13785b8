"""Routing policies by name: what ``kvrouter router --policy NAME`` runs.

``ttft`` (the default) and ``linear`` are kvrouter's own score (:mod:`router.decide.policy`).
Every other name is a baseline for the benchmark: it runs inside the real router, in place of
the score, and reads no block index (:class:`~router.baselines.baseline.Baseline`).
:data:`REGISTRY` names each baseline's class by import string, so a router imports only the
one it runs.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from router.baselines.baseline import Baseline, BaselineSettings, Tools

REGISTRY: Final[Mapping[str, str | None]] = {
    "ttft": None,  # kvrouter: router.decide.policy.decide, in the decider
    "linear": None,  # kvrouter's score in its linear mode
    "round-robin": "router.baselines.balance:RoundRobin",
    "least-load": "router.baselines.balance:LeastLoad",
    "seed": "router.baselines.seed:Seed",
    "sglang": "router.baselines.sglang:SGLang",
    "oracle": "router.baselines.oracle:Oracle",
}
"""Every policy by name, kvrouter's own first: the baseline class behind it, or ``None``."""

POLICIES: Final = tuple(REGISTRY)
"""The ``--policy`` choices, in the registry's order."""

BASELINES: Final = tuple(name for name, path in REGISTRY.items() if path is not None)
"""The policies that exist for the benchmark."""


def baseline_class(name: str) -> type[Baseline] | None:
    """The baseline class policy ``name`` runs; None for kvrouter's own (or an unknown name)."""
    path = REGISTRY.get(name)
    if path is None:
        return None
    module, _, attribute = path.partition(":")
    kind: type[Baseline] = getattr(importlib.import_module(module), attribute)
    return kind


def make_baseline(settings: BaselineSettings, tools: Tools, rng: random.Random) -> Baseline | None:
    """The baseline ``settings.policy`` names, or None for kvrouter's own policies."""
    kind = baseline_class(settings.policy)
    return None if kind is None else kind(settings, tools, rng)
