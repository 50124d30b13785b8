"""SGLang's ``cache_aware`` policy, as a baseline for the benchmark: ``sglang``.

If the router-local in-flight counts are imbalanced (``max - min >
balance_abs_threshold`` and ``max > balance_rel_threshold · min``) the least-loaded replica;
else the replica holding the longest prefix of the request text in an approximate
per-replica radix tree (:mod:`router.baselines.texttree`) built from this router's own decisions, if
that prefix covers more than ``cache_threshold`` of the text; else the least-loaded one. The
text is inserted under the chosen replica. Text is what SGLang's HTTP router routes on: the
messages' text contents joined by spaces, or the prompt
(:func:`~router.baselines.baseline.request_text`).
"""

from __future__ import annotations

import random
import time
from typing import Final

from router.baselines.baseline import (
    Baseline,
    BaselineSettings,
    Choice,
    Tools,
    baseline_score,
    request_text,
)
from router.baselines.texttree import TextTree
from router.decide.policy_types import Decision

SGLANG_EVICTION_INTERVAL_S: Final = 120.0
SGLANG_MAX_TREE_SIZE: Final = 1 << 26


class SGLang(Baseline):
    """The longest text prefix's holder above the cache threshold, else the least loaded."""

    name = "sglang"

    def __init__(self, settings: BaselineSettings, tools: Tools, rng: random.Random) -> None:
        super().__init__(settings, tools, rng)
        self.tree = TextTree(SGLANG_MAX_TREE_SIZE)
        self._evicted = time.monotonic()

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        settings = self.settings
        now = time.monotonic()
        if now - self._evicted >= SGLANG_EVICTION_INTERVAL_S:
            self._evicted = now
            self.tree.evict()
        text = request_text(choice.request)
        loads = self._local(choice)
        most, least = max(loads.values()), min(loads.values())
        imbalanced = (
            most - least > settings.sglang_balance_abs_threshold
            and most > settings.sglang_balance_rel_threshold * least
        )
        matched, holder = 0, None
        if not imbalanced:
            found = self.tree.match(text, loads.keys())
            matched, holder = found.chars, found.tenant
        if holder is not None and matched > settings.sglang_cache_threshold * len(text):
            picked = holder
        else:
            fewest = [r for r, n in loads.items() if n == least]
            picked = self.rng.choice(fewest)
        self.tree.insert(text, picked, now)
        scores = tuple(
            baseline_score(r.id, float(r.id == picked), cached=matched if r.id == picked else 0)
            for r in choice.candidates
        )
        return Decision(picked, scores, self.name), 0
