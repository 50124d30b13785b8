"""load_board: the load board that goes with the index a router opened."""

from __future__ import annotations

import pytest

from router.config import RouterSettings
from router.load import LocalLoadBoard, RedisLoadBoard
from router.service import load_board
from tracker.core.backends import open_index

SETTINGS = RouterSettings(
    replica=("r1=tcp://127.0.0.1:9,url=http://127.0.0.1:9",),
    router_id="router-1",
    lease_ttl_s=3.0,
    load_renew_s=0.5,
)


async def test_an_in_process_index_gets_a_board_of_its_own() -> None:
    index = open_index(None)
    assert isinstance(load_board(index, SETTINGS), LocalLoadBoard)
    await index.close()


async def test_a_shared_index_shares_the_load_through_its_client(redis_url: str) -> None:
    index = open_index(redis_url)
    try:
        board = load_board(index, SETTINGS)
        assert isinstance(board, RedisLoadBoard)
        assert board.client is index.client
        assert (board.router_id, board.lease_ttl_s, board.renew_interval_s) == (
            "router-1",
            3.0,
            0.5,
        )
    finally:
        await index.close()


async def test_a_shared_board_needs_the_router_id(redis_url: str) -> None:
    index = open_index(redis_url)
    try:
        with pytest.raises(ValueError, match="router_id"):
            load_board(index, RouterSettings(replica=SETTINGS.replica))
    finally:
        await index.close()
