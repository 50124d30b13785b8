"""ReuseBook: the blocks of each replica's cache that routed requests reused lately."""

from __future__ import annotations

import httpx
import pytest

from router.decide.reuse import ReuseBook
from router.http.proxy import REPLICA_HEADER
from router.metrics import RouterMetrics
from tests.clock import ManualClock
from tests.router.harness import SYSTEM, base_url, chat, engines, router


def test_before_a_whole_window_the_unwatched_share_of_the_residency_counts_too() -> None:
    clock = ManualClock(100.0)
    book = ReuseBook(30.0, clock=clock)
    assert book.valued("a", resident=1_000) == 1_000  # a restarted router: all may be hot
    assert book.valued("a", resident=None) is None  # and without the index it cannot say
    clock.now += 6.0
    book.record("a", root=1, blocks=300)
    assert book.valued("a", resident=1_000) == 800  # 24 s of the window still unwatched
    clock.now += 18.0
    assert book.valued("a", resident=1_000) == 300  # what it saw outweighs the rest: 200
    assert book.valued("b", resident=1_000) == 200
    clock.now += 6.0
    assert book.valued("b", resident=1_000) == 0  # watched, and nothing routed there was a hit
    assert book.valued("b", resident=None) == 0


def test_prefixes_sum_by_their_deepest_reuse_and_lapse_after_the_window() -> None:
    clock = ManualClock(100.0)
    book = ReuseBook(30.0, clock=clock)
    clock.now += 30.0
    book.record("a", root=1, blocks=300)
    book.record("a", root=2, blocks=300)
    book.record("a", root=1, blocks=120)  # a shorter hit of a prefix seen deeper
    book.record("a", root=3, blocks=0)  # a miss reuses nothing
    book.record("b", root=1, blocks=40)
    assert (book.valued("a", None), book.valued("b", None)) == (600, 40)
    assert (book.prefixes("a"), book.prefixes("b"), book.prefixes("c")) == (2, 1, 0)
    clock.now += 20.0
    book.record("a", root=2, blocks=310)  # a conversation grew: its turn's depth
    clock.now += 15.0  # root 1 was last reused 35 s ago
    assert book.valued("a", None) == 310
    assert book.prefixes("a") == 1
    clock.now += 20.0
    assert book.valued("a", None) == 0
    assert book.prefixes("a") == 0
    book.forget("b")
    assert book.valued("b", None) == 0


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        ReuseBook(0.0)


def test_a_replica_keeps_a_bounded_number_of_prefixes_oldest_first_out() -> None:
    clock = ManualClock(100.0)
    book = ReuseBook(30.0, clock=clock)
    clock.now += 30.0
    for root in range(10_000):
        book.record("a", root=root, blocks=1)
    assert book.valued("a", None) == 8_192  # the 1,808 oldest were dropped, and their blocks


async def test_a_routed_request_counts_its_whole_chain_where_it_was_sent() -> None:
    """Hit or miss, the replica a request went to holds its chain afterwards: a new prefix's
    copy is worth keeping before a second request reuses it. (Counted from the first hit
    only, an engine holding three prefixes whose third had not been asked for again looked
    to have room for a fourth in the 1,024-block matrix cell, and the group was moved later.)"""
    async with (
        engines(2) as fleet,
        router(replica=fleet.specs) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=20) as client,
    ):
        book = service.router.decider.reuse
        assert book is not None
        answer = await client.post("/v1/chat/completions", json=chat(SYSTEM, "first"))
        assert answer.status_code == 200
        chosen = answer.headers[REPLICA_HEADER]
        other = next(f"{fleet.prefix}{i}" for i in range(2) if f"{fleet.prefix}{i}" != chosen)
        blocks = answer.json()["usage"]["prompt_tokens"] // 16
        assert blocks > 20
        assert book.valued(chosen, resident=0) == blocks  # resident 0: only what it watched
        assert book.valued(other, resident=0) == 0
        again = await client.post("/v1/chat/completions", json=chat(SYSTEM, "a"))
        assert again.headers[REPLICA_HEADER] == chosen
        assert book.valued(chosen, resident=0) == blocks  # the deepest run of one chain


async def test_a_conversations_next_turn_is_measured_as_its_return_gap() -> None:
    """The router links a turn to the one before it by the marks of its prompt and exports the
    gap; a prompt that shares none of it links nothing."""
    long_system = SYSTEM * 12  # ~2k tokens: marks in the prompt's last quarter
    async with (
        engines(1) as fleet,
        router(replica=fleet.specs) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=20) as client,
    ):
        metrics = service.router.decider.metrics
        first = chat(long_system, "Tell me about the first topic in some detail, please.")
        answer = await client.post("/v1/chat/completions", json=first)
        assert answer.status_code == 200
        reply = answer.json()["choices"][0]["message"]["content"]
        other = chat("Answer tersely. " * 150, "Something unrelated.")
        assert (await client.post("/v1/chat/completions", json=other)).status_code == 200
        assert _return_gaps(metrics)["kvrouter_router_return_gap_seconds_count"] == 0.0
        turn = dict(first)
        turn["messages"] = [
            *first["messages"],
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And the second?"},
        ]
        assert (await client.post("/v1/chat/completions", json=turn)).status_code == 200
        samples = _return_gaps(metrics)
        assert samples["kvrouter_router_return_gap_seconds_count"] == 1.0
        assert 0.0 < samples["kvrouter_router_return_gap_seconds_sum"] < 20.0


def _return_gaps(metrics: RouterMetrics) -> dict[str, float]:
    return {s.name: s.value for m in metrics.return_gap.collect() for s in m.samples}
