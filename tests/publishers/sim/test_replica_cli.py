"""``kvrouter replica`` as a real process: two engines, registry, KV events, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import httpx
import pytest
import zmq
import zmq.asyncio

from publishers.config import ReplicaSettings
from tests.procs import KVROUTER, free_ports
from tracker.core.event_codec import decode_batch
from tracker.core.events import BlockStored, decode_message
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import ConfigError


async def wait_healthy(url: str, proc: asyncio.subprocess.Process, within: float = 20) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            assert proc.returncode is None, "kvrouter replica exited"
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(url)


@pytest.mark.redis
async def test_two_replicas_register_serve_publish_and_stop(
    redis_url: str, zctx: zmq.asyncio.Context
) -> None:
    http, events, replay = free_ports(2), free_ports(2), free_ports(2)
    args = [
        "replica",
        "--count", "2",
        "--port", str(http),
        "--events", f"tcp://*:{events}",
        "--replay", f"tcp://*:{replay}",
        "--model", "sim",
        "--redis", redis_url,
        "--time-scale", "0.01",
        "--heartbeat-s", "0.2",
        "--ttl-s", "2",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        str(KVROUTER), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    index = RedisIndex.from_url(redis_url)
    sub = zctx.socket(zmq.SUB)
    try:
        for i in range(2):
            await wait_healthy(f"http://127.0.0.1:{http + i}", proc)
        records = sorted(await index.replicas(), key=lambda r: r.id)
        assert [r.id for r in records] == ["replica-0", "replica-1"]
        for i, record in enumerate(records):
            assert record.url == f"http://127.0.0.1:{http + i}"
            assert record.events == f"tcp://127.0.0.1:{events + i}"
            assert record.replay == f"tcp://127.0.0.1:{replay + i}"
            assert (record.model, record.block_size) == ("sim", 16)
        assert records[0].instance == records[1].instance != ""

        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(records[1].events or "")
        await asyncio.sleep(0.3)  # PUB/SUB slow joiner
        async with httpx.AsyncClient(base_url=records[1].url or "") as client:
            body = {"model": "sim", "prompt": "a prompt long enough for two blocks " * 2}
            response = await client.post("/v1/completions", json={**body, "max_tokens": 3})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 3
        frames = await asyncio.wait_for(sub.recv_multipart(), 5)
        message = decode_message(frames)
        assert message.seq == 0
        assert any(isinstance(e, BlockStored) for e in decode_batch(message.payload).events)

        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, stderr.decode()
        assert await index.replicas() == []
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        sub.close(linger=0)
        await index.close()


def test_bad_settings_exit_with_a_clear_message() -> None:
    # by default replay sits one port above the events, so 2 engines collide
    result = subprocess.run(
        [str(KVROUTER), "replica", "--count", "2"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "port collision" in result.stderr


def test_settings_from_env() -> None:
    settings = ReplicaSettings.from_env(
        {
            "KVROUTER_REPLICA_COUNT": "3",
            "KVROUTER_REPLICA_REPLAY": "none",
            "KVROUTER_REPLICA_ERA": "0.11.0",
        }
    )
    assert (settings.count, settings.replay, settings.wire_era.value) == (3, None, "v0.10.2")
    with pytest.raises(ConfigError):
        ReplicaSettings.from_env({"KVROUTER_REPLICA_ERA": "latest"})
    with pytest.raises(ConfigError, match="heartbeat"):
        ReplicaSettings(heartbeat_s=10, ttl_s=15)


def test_lookahead_hashing_needs_an_era_that_sends_it() -> None:
    assert ReplicaSettings(lookahead_tokens=2).lookahead_tokens == 2  # the default era: v0.33
    with pytest.raises(ConfigError, match=r"v0\.33\.0"):
        ReplicaSettings(lookahead_tokens=1, era="v0.32.0")
    with pytest.raises(ConfigError, match=">= 0"):
        ReplicaSettings(lookahead_tokens=-1)
