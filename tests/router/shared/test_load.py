"""Load leases on the router's own board: exact local totals, pending prefills, partitions."""

from __future__ import annotations

import time

import pytest

from router.shared.load import Load, LoadBoard, LocalLoadBoard
from tests.factories import LOAD as NS
from tests.factories import LOAD_OTHER as OTHER
from tracker.core.blocks import Namespace


def test_leases_keep_exact_local_totals() -> None:
    board = LocalLoadBoard()
    a = board.acquire(NS, "r1", 1000)
    b = board.acquire(NS, "r1", 500)
    c = board.acquire(NS, "r2", 0)
    assert board.local_snapshot(NS) == {"r1": Load(2, 1500), "r2": Load(1, 0)}
    a.first_token()
    a.first_token()  # idempotent
    assert board.local_snapshot(NS)["r1"] == Load(2, 500)
    a.release()
    a.release()
    a.first_token()  # after release: nothing
    b.release()  # released before its first token: its tokens go too
    assert board.local_snapshot(NS) == {"r2": Load(1, 0)}
    with c:
        pass
    assert board.local_snapshot(NS) == {}
    assert (a.released, a.prefilling, c.released) == (True, False, True)
    with pytest.raises(ValueError):
        board.acquire(NS, "r1", -1)


def test_the_snapshot_says_since_when_the_engine_works_on_the_pending_prefills() -> None:
    board = LocalLoadBoard()
    assert board.local_snapshot(NS) == {}
    a = board.acquire(NS, "r1", 1000)
    b = board.acquire(NS, "r1", 500)
    c = board.acquire(Namespace("llama", 16, "adapter"), "r2", 10)  # the base partition
    view = board.local_snapshot(NS)
    assert view["r1"].prefill_since == a.started <= b.started
    assert view["r2"].prefill_since == c.started
    before = time.monotonic()
    a.first_token()  # done prefilling: the engine spent the time until now on a, not b
    since = board.local_snapshot(NS)["r1"].prefill_since
    assert since is not None and b.started <= before <= since <= time.monotonic()
    b.release()  # in flight no more, before its first token
    c.first_token()  # decoding: in flight, nothing pending
    a.release()
    view = board.local_snapshot(NS)
    assert "r1" not in view
    assert view["r2"] == Load(1, 0) and view["r2"].prefill_since is None


def test_lora_requests_count_towards_the_base_partition() -> None:
    board = LocalLoadBoard()
    board.acquire(Namespace("llama", 16, lora_name="sql"), "r1", 10)
    board.acquire(OTHER, "r1", 7)
    assert board.local_snapshot(NS) == {"r1": Load(1, 10)}
    assert board.local_snapshot(OTHER) == {"r1": Load(1, 7)}


async def test_local_board_snapshot_is_its_local_view() -> None:
    board: LoadBoard = LocalLoadBoard()
    await board.start()
    lease = board.acquire(NS, "r1", 3)
    assert await board.snapshot(NS) == {"r1": Load(1, 3)}
    lease.release()
    await board.stop()
