"""Outside traffic: which conversations bypass the routers, and to which engine."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.loadgen import LoadGenerator
from bench.workloads import Conversation, Turn

ENGINES = ["http://e0", "http://e1", "http://e2", "http://e3"]


def conversations(n: int) -> list[Conversation]:
    return [Conversation(i, i % 7, None, (Turn("hi", 1),)) for i in range(n)]


def test_a_seeded_share_of_conversations_goes_straight_to_one_engine_each() -> None:
    gen = LoadGenerator("http://router", time_scale=1, bypass_urls=ENGINES, bypass_share=0.25)
    targets = [gen.target(c) for c in conversations(2000)]
    direct = [t for t in targets if t is not None]
    assert 0.22 < len(direct) / len(targets) < 0.28
    assert set(Counter(direct)) == set(ENGINES)
    again = LoadGenerator("http://router", time_scale=1, bypass_urls=ENGINES, bypass_share=0.25)
    assert [again.target(c) for c in conversations(2000)] == targets  # same for every policy
    other = LoadGenerator(
        "http://router", time_scale=1, bypass_urls=ENGINES, bypass_share=0.25, seed=2
    )
    assert [other.target(c) for c in conversations(2000)] != targets
    none = LoadGenerator("http://router", time_scale=1)
    assert all(none.target(c) is None for c in conversations(50))


def test_bypass_needs_engines_and_a_share_in_range() -> None:
    with pytest.raises(ValueError):
        LoadGenerator("http://router", time_scale=1, bypass_share=0.5)
    with pytest.raises(ValueError):
        LoadGenerator("http://router", time_scale=1, bypass_urls=ENGINES, bypass_share=1.5)
