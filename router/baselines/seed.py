"""The design this project started from, as a baseline for the benchmark: ``seed``.

Key = SHA-256 of the system prompt(s) plus the first ``seed_user_chars`` characters of the
first user message (``docs/benchmarks.md``); each replica remembers the keys it was sent in
an LRU map (2,000 keys, 30 min TTL); ``score = 100·is_cached - 10·in_flight`` with this
router's own in-flight count; best score, ties at random.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import OrderedDict
from typing import Final

from router.baselines.baseline import (
    Baseline,
    BaselineSettings,
    Choice,
    Tools,
    baseline_score,
    best,
    message_text,
    request_text,
)
from router.decide.policy_types import Decision
from router.decide.request import PromptRequest

SEED_LRU_SIZE: Final = 2000
SEED_TTL_S: Final = 1800.0


def seed_key(request: PromptRequest, user_chars: int) -> str:
    """The seed design's prefix key: system prompt(s) + first characters of the user message."""
    system, user = [], ""
    for message in request.messages or ():
        if not isinstance(message, dict):
            continue
        if message.get("role") in ("system", "developer"):
            system.append(message_text(message))
        elif message.get("role") == "user":
            user = message_text(message)
            break
    if request.messages is None:
        user = request_text(request)
    text = "\n".join(system) + "\x00" + user[:user_chars]
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Seed(Baseline):
    """``100·is_cached - 10·in_flight`` over keys each replica was sent (LRU with TTL)."""

    name = "seed"

    def __init__(self, settings: BaselineSettings, tools: Tools, rng: random.Random) -> None:
        super().__init__(settings, tools, rng)
        self._seen: dict[str, OrderedDict[str, float]] = {}

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        key = seed_key(choice.request, self.settings.seed_user_chars)
        now = time.monotonic()
        inflight = self._local(choice)
        scores = []
        for replica in choice.candidates:
            seen = self._seen.setdefault(replica.id, OrderedDict())
            at = seen.get(key)
            cached = at is not None and now - at <= SEED_TTL_S
            scores.append(baseline_score(replica.id, 100.0 * cached - 10.0 * inflight[replica.id]))
        decision = best(scores, self.rng, self.name)
        seen = self._seen[decision.replica]
        seen[key] = now
        seen.move_to_end(key)
        while len(seen) > SEED_LRU_SIZE:
            seen.popitem(last=False)
        return decision, 0
