"""ReturnBook: how soon a finished request's continuation comes back, and the policy's use of
it: a long prompt goes where it starts soonest beside requests that will not come back within
its prefill (a chat's next turn a minute later), and stays off an engine whose requests come
back within it (an agent's next call)."""

from __future__ import annotations

import random

import pytest

from router.decide.policy import decide
from router.decide.policy_types import DEFAULT_SPEED, PolicyConfig, ReplicaState
from router.decide.returns import (
    FIRST_MARK,
    MARK_EVERY,
    MAX_RECORDS,
    MIN_RESOLVED,
    ReturnBook,
    marks_of,
)
from router.decide.scoring import prefill_work
from tests.clock import ManualClock


def _prompt(conversation: int, blocks: int) -> list[int]:
    """Block keys of a conversation's prompt: a prefix every conversation shares (the first
    :data:`FIRST_MARK` blocks), then its own."""
    return list(range(FIRST_MARK)) + [conversation * 1_000_000 + i for i in range(blocks)]


def test_marks_are_every_32nd_block_of_the_last_quarter_past_the_shared_start() -> None:
    keys = list(range(1_000))
    marks = marks_of(keys)
    assert marks == [i for i in range(999, 749, -1) if (i + 1) % MARK_EVERY == 0]
    assert marks_of(list(range(FIRST_MARK))) == []  # no block past the start: unmarked
    assert marks_of(list(range(80))) == [FIRST_MARK]  # the start is never marked
    assert FIRST_MARK not in marks_of(list(range(2_000)))


def test_a_continuation_links_to_its_finished_turn_once() -> None:
    clock = ManualClock(100.0)
    book = ReturnBook(clock=clock)
    first = _prompt(1, 400)
    book.finished(first)
    clock.now += 3.0
    book.arrived(first + [7] * 200)  # the next turn: the whole earlier prompt, then more
    book.arrived(first + [8] * 200)  # a second request from the same history: not again
    book.arrived(_prompt(2, 400))  # another conversation: shares only the start
    clock.now += 100.0
    for other in range(3, 3 + MIN_RESOLVED):
        book.finished(_prompt(other, 400))  # finished now: no chance to come back yet
    assert book.share(2_000) == 1.0  # only one request had the chance to come back
    clock.now += 10.0
    # of the 9 finished 10 s ago or more, one came back, 3 s after its finish
    assert book.share(2_999) == 0.0
    assert book.share(3_000) == pytest.approx(1 / 9)
    assert book.share(9_000) == pytest.approx(1 / 9)


def test_the_requests_finished_on_one_prefix_all_come_back_with_the_next_one() -> None:
    """A group's requests share a long prefix and differ in a short question: the next one
    on that prefix brings back every one finished before it (each once)."""
    clock = ManualClock()
    book = ReturnBook(clock=clock)
    prefix = _prompt(1, 400)
    book.finished([*prefix, 11])
    clock.now += 1.0
    book.finished([*prefix, 12])
    clock.now += 1.0
    assert sorted(book.arrived([*prefix, 13])) == [1.0, 2.0]
    assert book.arrived([*prefix, 14]) == []  # both came back already


def test_the_share_counts_only_the_requests_that_had_the_window_to_come_back() -> None:
    clock = ManualClock()
    book = ReturnBook(clock=clock)
    for conversation in range(MIN_RESOLVED * 2):
        book.finished(_prompt(conversation, 200))
        clock.now += 1.0
    # 16 finished, one a second; half of them within the last 8 s
    for conversation in range(MIN_RESOLVED * 2 - 4, MIN_RESOLVED * 2):
        book.arrived(_prompt(conversation, 300))  # the last four came back already
    assert book.share(0.0) == 0.0  # none came back the moment it finished
    assert book.share(4_000) == pytest.approx(4 / 13)  # all 4 within 4 s; 13 had 4 s
    # 8 s: the 9 that finished 8 s or more ago had the chance; the 4 back (in under 4 s)
    # count too, so the share errs towards counting a request
    assert book.share(8_000) == pytest.approx(4 / 9)
    assert book.share(13_000) == 1.0  # 4 had the chance: too few to tell


def test_the_oldest_records_go_first_and_take_their_gaps_along() -> None:
    clock = ManualClock()
    book = ReturnBook(clock=clock)
    book.finished(_prompt(0, 200))
    clock.now += 1.0
    book.arrived(_prompt(0, 250))  # came back after 1 s
    for conversation in range(1, MAX_RECORDS + 1):
        book.finished(_prompt(conversation, 200))
    assert len(book) == MAX_RECORDS
    clock.now += 5.0
    assert book.share(5_000) == 0.0  # the one that came back was dropped with its gap
    book.arrived(_prompt(0, 300))  # its marks went with it: nothing to link
    assert book.share(5_000) == 0.0


def test_short_prompts_leave_no_marks_and_link_nothing() -> None:
    book = ReturnBook(clock=ManualClock())
    book.finished(list(range(FIRST_MARK)))
    book.arrived(list(range(FIRST_MARK)))
    assert len(book) == 0 and book.share(0.0) == 1.0


# --- the policy -------------------------------------------------------------------------------

LONG = 60_000
CONFIG = PolicyConfig()


def _engines(returns: ReturnBook | None) -> list[ReplicaState]:
    """Two engines with room in their caches and 7 and 2 requests decoding; the quiet one
    started a cold 100k-token prefill half a second ago, the busy one has nothing queued."""
    share = returns.share if returns is not None else None
    busy = ReplicaState("busy", inflight=7, returns=share, cache_blocks=100_000, resident_blocks=0)
    prefilling = ReplicaState(
        "prefilling",
        inflight=2,
        queued_prefill_tokens=round(prefill_work(100_000, 0, CONFIG.attention_tokens)),
        prefill_elapsed_ms=500.0,
        returns=share,
        cache_blocks=100_000,
        resident_blocks=0,
    )
    return [busy, prefilling]


def _book(gap_s: float, back: float) -> ReturnBook:
    """A book of 100 finished requests, ``back`` of which came back ``gap_s`` after."""
    clock = ManualClock()
    book = ReturnBook(clock=clock)
    for conversation in range(100):
        book.finished(_prompt(conversation, 300))
    clock.now += gap_s
    for conversation in range(round(100 * back)):
        book.arrived(_prompt(conversation, 400))
    clock.now += 120.0
    return book


def test_a_long_prompt_starts_beside_requests_that_will_not_come_back_within_its_prefill() -> None:
    """A chat: a third of the requests come back, a minute after they finish. The cold 60k
    prompt starts at once on the engine busy decoding, not behind the other's 100k prefill."""
    states = _engines(_book(gap_s=60.0, back=0.3))
    scores = {s.replica: s for s in decide(LONG, states, CONFIG, random.Random(0)).scores}
    assert scores["busy"].expected_ttft_ms < scores["prefilling"].expected_ttft_ms
    assert decide(LONG, states, CONFIG, random.Random(0)).replica == "busy"


def test_a_long_prompt_stays_off_an_engine_whose_requests_come_back_within_its_prefill() -> None:
    """Agents: nearly every request comes back within a second; the 7 decoding on the busy
    engine would each wait for the whole prefill, so the prompt queues on the quieter one, as
    it does with no book at all (every request in flight counts)."""
    for book in (_book(gap_s=1.0, back=0.95), None):
        assert decide(LONG, _engines(book), CONFIG, random.Random(0)).replica == "prefilling"


def test_a_continuation_does_not_leave_home_to_save_a_little_queueing() -> None:
    """With returns a minute apart (a chat), a 30k-token turn cached at home, where 2 s of
    prefill are queued, could start sooner as a cold copy beside 4 requests decoding; the
    copy's extra work is charged to those 4, so it stays home."""
    book = _book(gap_s=60.0, back=0.3)
    size = CONFIG.block_size
    home = ReplicaState(
        "home",
        matched_blocks=29_000 // size,
        matched_gpu_blocks=29_000 // size,
        inflight=4,
        queued_prefill_tokens=round(2_000 / DEFAULT_SPEED.prefill_ms_per_token),
        returns=book.share,
        cache_blocks=100_000,
        resident_blocks=0,
    )
    other = ReplicaState(
        "other", inflight=4, returns=book.share, cache_blocks=100_000, resident_blocks=0
    )
    decision = decide(30_000, [home, other], CONFIG, random.Random(0))
    scores = {s.replica: s for s in decision.scores}
    assert scores["other"].expected_ttft_ms < scores["home"].expected_ttft_ms
    assert decision.replica == "home"
