"""RedisIndex through Redis outages: paused, restarted empty, unreachable; and a bad URL."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import warnings
from collections.abc import Iterator

import pytest

from tests.factories import LLAMA, batch
from tests.procs import RedisServer, free_port
from tests.tracker.redis_ops import OTHER, SEQ, matches, remove, store
from tracker.core.blocks import block_keys
from tracker.core.index import ReplicaRecord
from tracker.core.redis_index import RedisIndex
from tracker.core.redis_writes import OPS_PER_CALL
from tracker.framework.errors import ConfigError, IndexUnavailableError


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A redis-server this test may stop, pause and restart (not the shared session one)."""
    server = RedisServer().start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)
    server.close()


# ------------------------------------------------------------------ outages


async def test_pending_writes_survive_a_paused_redis(own_server: RedisServer) -> None:
    index = RedisIndex.from_url(own_server.url, timeout_s=0.3)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ, range(2)), store(OTHER, range(1))), 1)
        assert own_server.proc is not None
        os.kill(own_server.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(IndexUnavailableError):
                await index.apply("r1", LLAMA, batch(store(SEQ, range(2, 4))), 2)
            with pytest.raises(IndexUnavailableError):
                await index.apply("r1", LLAMA, batch(store(OTHER, range(1, 4))), 3)
            with pytest.raises(IndexUnavailableError):
                await index.apply("r1", LLAMA, batch(remove(OTHER, 3)), 4)
            assert await index.last_seq("r1", LLAMA) == 4  # answered from the pending write
            assert await index.flush() == 1
        finally:
            os.kill(own_server.proc.pid, signal.SIGCONT)
        # Requests that timed out during the pause are still queued in the server; let them
        # run before checking, they carry older (idempotent) states of the same pending write.
        await asyncio.sleep(0.3)
        assert await index.flush() == 0
        assert await index.flush() == 0
        fresh = RedisIndex.from_url(own_server.url)
        try:
            assert await matches(fresh, SEQ) == {"r1": (4, 4)}
            assert await matches(fresh, OTHER) == {"r1": (3, 3)}
            assert await fresh.last_seq("r1", LLAMA) == 4
            assert await fresh.block_count("r1", LLAMA) == 7
        finally:
            await fresh.close()
    finally:
        await index.close()


async def test_redis_restarted_empty_gets_the_whole_state_back(own_server: RedisServer) -> None:
    index = RedisIndex.from_url(own_server.url, timeout_s=0.5)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ, range(2))), 1)
        await index.apply("r2", LLAMA, batch(store(OTHER)), 1)
        own_server.stop()
        with pytest.raises(IndexUnavailableError):
            await index.apply("r1", LLAMA, batch(store(SEQ, range(2, 4))), 2)
        assert await index.flush() == 1
        own_server.start()  # same port, no data
        assert await index.flush() == 0
        # r1 had a pending write: Redis lost its id, so its whole state was written again.
        assert await matches(index, SEQ) == {"r1": (4, 4)}
        assert await index.last_seq("r1", LLAMA) == 2
        # r2 was idle: nothing wrote it back yet; the tracker's periodic check does.
        assert await matches(index, OTHER) == {}
        assert await index.restore_lost() == 1
        assert await matches(index, OTHER) == {"r2": (4, 4)}
        assert await index.last_seq("r2", LLAMA) == 1
        assert await index.restore_lost() == 0  # nothing lost any more
        await index.apply("r2", LLAMA, batch(), 2)
        assert await matches(index, OTHER) == {"r2": (4, 4)}
        restarted = RedisIndex.from_url(own_server.url)
        try:
            assert await restarted.block_count("r1", LLAMA) == 4
            assert await restarted.block_count("r2", LLAMA) == 4
        finally:
            await restarted.close()
    finally:
        await index.close()


async def test_rid_taken_after_data_loss_is_reallocated(own_server: RedisServer) -> None:
    index = RedisIndex.from_url(own_server.url, timeout_s=0.5)
    other = RedisIndex.from_url(own_server.url, timeout_s=0.5)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        old_rid = await index.writer.rid("r1", LLAMA)
        own_server.stop()
        own_server.start()
        # Another tracker registers a new replica first and is handed r1's old id.
        await other.apply("r3", LLAMA, batch(store(OTHER)), 1)
        assert await other.writer.rid("r3", LLAMA) == old_rid
        await index.apply("r1", LLAMA, batch(store(SEQ, range(1))), 2)
        assert await index.writer.rid("r1", LLAMA) != old_rid
        assert await matches(index, SEQ) == {"r1": (4, 4)}
        assert await matches(index, OTHER) == {"r3": (4, 4)}
        assert await index.last_seq("r1", LLAMA) == 2
    finally:
        await index.close()
        await other.close()


async def test_unreachable_redis_raises_index_unavailable() -> None:
    index = RedisIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3)
    try:
        with pytest.raises(IndexUnavailableError):
            await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        with pytest.raises(IndexUnavailableError):
            await index.lookup(LLAMA, block_keys(SEQ, LLAMA))
        with pytest.raises(IndexUnavailableError):
            await index.register(ReplicaRecord(id="r1", model="llama", block_size=4))
        with pytest.raises(IndexUnavailableError):
            await index.replicas()
        with pytest.raises(IndexUnavailableError):
            await index.deregister("r1")
        assert not await index.ping()
        assert await index.flush() == 0
    finally:
        await index.close()


async def test_failed_multi_call_write_leaks_no_connection(own_server: RedisServer) -> None:
    index = RedisIndex.from_url(own_server.url, timeout_s=0.5)
    tokens = list(range(4 * (OPS_PER_CALL + 10)))
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        own_server.stop()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with pytest.raises(IndexUnavailableError):
                    await index.apply("r1", LLAMA, batch(store(tokens)), 2)
            gc.collect()
        assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        own_server.start()
        assert await index.flush() == 0
        found = await index.lookup(LLAMA, block_keys(tokens, LLAMA))
        assert found["r1"].blocks == OPS_PER_CALL + 10
    finally:
        await index.close()


def test_bad_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Redis URL"):
        RedisIndex.from_url("http://127.0.0.1:6379")
