"""load_board: the router's own load board, or one shared through a Redis client."""

from __future__ import annotations

import pytest

from router.config import RouterSettings
from router.router import load_board
from router.shared.load import LocalLoadBoard
from router.shared.redis_load import RedisLoadBoard
from tracker.core.backends import open_index

SETTINGS = RouterSettings(
    replica=("r1=tcp://127.0.0.1:9,url=http://127.0.0.1:9",),
    router_id="router-1",
    lease_ttl_s=3.0,
    load_renew_s=0.5,
)


def test_without_redis_a_router_has_a_board_of_its_own() -> None:
    assert isinstance(load_board(SETTINGS), LocalLoadBoard)


async def test_a_shared_index_shares_the_load_through_its_client(redis_url: str) -> None:
    index = open_index(redis_url)
    try:
        board = load_board(SETTINGS, index.client)
        assert isinstance(board, RedisLoadBoard)
        assert board.client is index.client
        assert (board.router_id, board.lease_ttl_s, board.renew_interval_s) == (
            "router-1",
            3.0,
            0.5,
        )
        assert board.view_refresh_s == 0.0
        background = load_board(SETTINGS, index.client, view_refresh_s=0.01)
        assert isinstance(background, RedisLoadBoard)
        assert background.view_refresh_s == 0.01
    finally:
        await index.close()


async def test_a_shared_board_needs_the_router_id(redis_url: str) -> None:
    index = open_index(redis_url)
    try:
        with pytest.raises(ValueError, match="router_id"):
            load_board(RouterSettings(replica=SETTINGS.replica), index.client)
    finally:
        await index.close()
