"""How soon a finished request's continuation comes back: which requests in flight a prefill
beside them will keep waiting.

A request in flight on an engine is delayed by a prefill placed there only while it decodes
(its steps share the prefill's); what a long prefill costs in TTFT falls on the requests that
arrive bound to that engine before it ends: a conversation's next turn, an agent's next tool
call, a burst of subagents from the same history. How many of the requests in flight do that
depends on the traffic: a coding agent's next call follows its answer within a second or two,
a chat user's next turn (Mooncake's conversation trace) a minute later, and many requests are
never continued at all.

:class:`ReturnBook` measures it. Each finished request leaves marks (block keys of its
prompt, below); a later request whose prompt carries one reuses at least three quarters of it
(its next turn, or another request on the same long prefix: either way bound to where it is
cached), and the time from the finish to that arrival is a return gap
(``kvrouter_router_return_gap_seconds``). :meth:`ReturnBook.share` answers, for a window of
``w`` ms, the part of the requests finished at least ``w`` ago that came back within ``w``:
the policy counts that share of an engine's requests in flight as the ones a prefill there
delays (:mod:`router.decide.scoring`, compute). Until enough requests have had the chance, the
share is 1 (every request in flight counts, as before the book).

Soft state, per router: a router links only the continuations that reach it of the requests
it finished, so behind a balancer that spreads a conversation's turns over R routers the share
reads up to R times low (docs/architecture.md, "Score", compute).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final

MARK_EVERY: Final = 32
"""Marks sit on every this-many-th block (the index's segment length): a continuation's key at
the same position is the same key, so an arrival checks one key in this many."""

FIRST_MARK: Final = 2 * MARK_EVERY - 1
"""No mark before this block: a prompt's first blocks are often a prefix unrelated prompts
share (a system prompt, the trace's common first 512 tokens), and would link them."""

MAX_RECORDS: Final = 1_024
"""Finished requests kept; the oldest go first (windows longer than they span read 1)."""

MIN_RESOLVED: Final = 8
"""Requests that must have had the chance to come back before a share is measured."""


class _Record:
    __slots__ = ("finished", "gap", "marks")

    def __init__(self, finished: float, marks: list[int]) -> None:
        self.finished = finished
        self.gap: float | None = None
        self.marks = marks


def _finish_time(record: _Record) -> float:
    return record.finished


def marks_of(keys: Sequence[int]) -> list[int]:
    """The keys a finished prompt is known by: every :data:`MARK_EVERY`-th block of its last
    quarter, from :data:`FIRST_MARK` on. Not its last blocks: they hold the chat template's
    generation prompt, which the next turn replaces with the answer."""
    n = len(keys)
    last = MARK_EVERY * (n // MARK_EVERY) - 1
    lowest = max(FIRST_MARK, (3 * n) // 4)
    return [keys[i] for i in range(last, lowest - 1, -MARK_EVERY)]


class ReturnBook:
    """Return gaps of the requests this router finished (module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._records: deque[_Record] = deque()  # in the order they finished
        self._by_mark: dict[int, list[_Record]] = {}  # the records not back yet
        self._gaps: list[float] = []  # sorted: the kept records' that came back

    def __len__(self) -> int:
        return len(self._records)

    def finished(self, keys: Sequence[int]) -> None:
        """A request with these block keys finished (its answer ended)."""
        marks = marks_of(keys)
        if not marks:
            return  # too short to tell its continuation from a prompt sharing its prefix
        record = _Record(self.clock(), marks)
        self._records.append(record)
        for mark in marks:
            self._by_mark.setdefault(mark, []).append(record)
        while len(self._records) > MAX_RECORDS:
            self._drop()

    def _drop(self) -> None:
        old = self._records.popleft()
        if old.gap is not None:
            del self._gaps[bisect.bisect_left(self._gaps, old.gap)]
            return  # its marks went when it came back
        self._unlist(old)

    def _unlist(self, record: _Record) -> None:
        """Take ``record`` off the lists of the records waiting on its marks."""
        for mark in record.marks:
            waiting = self._by_mark.get(mark)
            if waiting is not None and record in waiting:
                waiting.remove(record)
                if not waiting:
                    del self._by_mark[mark]

    def arrived(self, keys: Sequence[int]) -> list[float]:
        """A request with these block keys was sent: every finished request not back yet
        whose marks it carries came back now (each comes back once: a group's requests on one
        long prefix all do when the next one arrives); return their gaps in seconds."""
        if not self._by_mark:
            return []
        back: list[_Record] = []
        for key in keys[MARK_EVERY - 1 :: MARK_EVERY]:
            back.extend(self._by_mark.pop(key, ()))  # only records not back yet are listed
        now = self.clock()
        gaps = []
        for record in back:
            if record.gap is not None:
                continue  # came back by another of its marks
            record.gap = max(0.0, now - record.finished)
            bisect.insort(self._gaps, record.gap)
            gaps.append(record.gap)
            self._unlist(record)
        return gaps

    def share(self, window_ms: float) -> float:
        """Of the requests finished at least ``window_ms`` ago, the part that came back within
        ``window_ms`` (those finished since that came back already count too: the share errs
        towards counting a request); 1 while fewer than :data:`MIN_RESOLVED` had the chance."""
        window = max(0.0, window_ms) / 1000.0
        older = bisect.bisect_right(self._records, self.clock() - window, key=_finish_time)
        if older < MIN_RESOLVED:
            return 1.0
        return min(1.0, bisect.bisect_right(self._gaps, window) / older)
