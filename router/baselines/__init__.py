"""Routing policies by name: what ``kvrouter router --policy NAME`` runs.

``ttft`` (the default) and ``linear`` are kvrouter's own policy, two modes of one score
(:mod:`router.decide.policy`): the placer scores every candidate from the block index, the load
board and the engines' gauges (:class:`router.decide.placement.Placer`). Every other name is a
baseline that exists for the benchmark (``kvrouter bench``, ``docs/benchmarks.md``): it runs
inside the real router, so it pays the same proxy path as kvrouter's policy, and reads no
block index (:class:`~router.baselines.baseline.Baseline`).

:data:`REGISTRY` names the class behind each baseline by import string, as uvicorn names its
implementations: the settings (:mod:`router.config`) list the policies without importing the
baselines, and a router imports only the one it runs.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from router.baselines.baseline import Baseline, BaselineSettings, Tools

REGISTRY: Final[Mapping[str, str | None]] = {
    "ttft": None,  # kvrouter: router.decide.policy.decide, in the placer
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
