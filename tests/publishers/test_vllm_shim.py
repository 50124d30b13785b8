"""The vLLM attach shim: flags, validation, heartbeats against a real redis-server."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from publishers.config import AttachSettings
from publishers.registration import RegistrationService
from publishers.vllm import (
    attach,
    attach_record,
    kv_events_config,
    launch_line,
    register,
    vllm_env,
    vllm_flags,
)
from publishers.zmq import endpoint_for_rank
from tests.procs import KVROUTER, RedisServer
from tracker.core.index import ReplicaRecord
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import ConfigError
from tracker.framework.http import HTTPServer, bind


def settings(**overrides: Any) -> AttachSettings:
    base: dict[str, Any] = {
        "redis": "redis://127.0.0.1:1/0",
        "id": "r1",
        "url": "http://127.0.0.1:8000",
        "events": "tcp://vllm-0:5557",
        "replay": "tcp://vllm-0:5558",
    }
    return AttachSettings(**(base | overrides))


async def until(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


def test_flags_are_exactly_what_vllm_needs() -> None:
    flags = vllm_flags(settings(block_size=32))
    assert flags[:4] == ["--enable-prefix-caching", "--block-size", "32", "--kv-events-config"]
    assert json.loads(flags[4]) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "",
    }
    assert len(flags) == 5
    no_replay = kv_events_config(settings(replay="none", topic="kv"))
    assert "replay_endpoint" not in no_replay
    assert no_replay["topic"] == "kv"
    named = vllm_flags(settings(model="llama", data_parallel_size=2, replay="tcp://h:5600"))
    assert named[5:] == [
        "--served-model-name",
        "llama",
        "--data-parallel-size",
        "2",
        "--data-parallel-rank",
        "0",
    ]


def test_launch_line_sets_the_hash_seed_and_round_trips_through_a_shell() -> None:
    s = settings(hash_seed="42")
    assert vllm_env(s) == {"PYTHONHASHSEED": "42"}
    line = launch_line(s, "meta-llama/Llama-3.1-8B-Instruct")
    words = shlex.split(line)
    assert words[:4] == ["PYTHONHASHSEED=42", "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert words[4:] == vllm_flags(s)


def test_print_flags_command() -> None:
    out = subprocess.run(
        [str(KVROUTER), "attach", "--print-flags", "--block-size", "64"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert out.startswith("PYTHONHASHSEED=0 vllm serve MODEL --enable-prefix-caching")
    assert "--block-size 64" in out


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"events": "tcp://*:5557"}, "bind address"),
        ({"events": "tcp://0.0.0.0:5557"}, "bind address"),
        ({"events": "http://h:5557"}, "tcp://HOST:PORT"),
        ({"events": "tcp://h:5557", "replay": "tcp://h:5557"}, "port collision"),
        # vLLM offsets both endpoints by the DP rank: 5557..5560 overlaps replay 5558
        ({"data_parallel_size": 4}, "port collision"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data-parallel-rank"),
        ({"events": "ipc:///tmp/kv", "replay": None, "data_parallel_size": 2}, "ipc"),
        ({"block_size": 0}, "block-size"),
        ({"heartbeat_s": 10.0, "ttl_s": 15.0}, "heartbeat"),
    ],
)
def test_invalid_settings(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        settings(**overrides)


def test_settings_from_env_and_required_fields() -> None:
    env = {
        "KVROUTER_ATTACH_REDIS": "redis://r:6379/0",
        "KVROUTER_ATTACH_ID": "pod-3",
        "KVROUTER_ATTACH_URL": "http://pod-3:8000",
        "KVROUTER_ATTACH_EVENTS": "tcp://pod-3:5557",
        "KVROUTER_ATTACH_REPLAY": "none",
        "KVROUTER_ATTACH_BLOCK_SIZE": "32",
    }
    s = AttachSettings.from_env(env)
    s.require_attach()
    assert (s.id, s.block_size, s.replay) == ("pod-3", 32, None)
    with pytest.raises(ConfigError, match="url is required"):
        AttachSettings.from_env({k: v for k, v in env.items() if "URL" not in k}).require_attach()
    with pytest.raises(ConfigError, match="http"):
        settings(url="pod-3:8000").require_attach()
    with pytest.raises(ConfigError, match="replica id"):
        settings(id="bad id").require_attach()
    assert settings(data_parallel_size=4, replay="tcp://vllm-0:5600").data_parallel_size == 4


def test_dp_rank_rewrites_ports_as_vllm_does() -> None:
    assert endpoint_for_rank("tcp://h:5557", 0) == "tcp://h:5557"
    assert endpoint_for_rank("tcp://h:5557", 3) == "tcp://h:5560"
    assert endpoint_for_rank("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(ValueError):
        endpoint_for_rank("ipc:///tmp/kv", 1)
    s = settings(data_parallel_size=4, data_parallel_rank=2, replay="tcp://vllm-0:5600")
    record = attach_record(s, "inst")
    assert (record.events, record.replay) == ("tcp://vllm-0:5559", "tcp://vllm-0:5602")
    assert (record.id, record.model, record.block_size, record.instance) == (
        "r1",
        "default",
        16,
        "inst",
    )
    # the flags keep the base ports: vLLM adds the rank itself
    assert json.loads(vllm_flags(s)[4])["endpoint"] == "tcp://*:5557"


@pytest.mark.redis
async def test_registration_heartbeats_and_deregisters(redis_index: RedisIndex) -> None:
    record = ReplicaRecord(id="r1", model="m", block_size=16, url="http://h:1", ttl_s=5)
    service = RegistrationService(redis_index, [record], interval_s=0.05)
    await service.start()
    first = (await redis_index.replicas())[0]
    assert (first.id, first.url) == ("r1", "http://h:1")
    await until(lambda: _seen_after(redis_index, first.last_seen))
    assert service.beats >= 2 and service.registered
    await service.stop()
    assert await redis_index.replicas() == []


async def _seen_after(index: RedisIndex, stamp: float) -> bool:
    return any(r.last_seen > stamp for r in await index.replicas())


@pytest.mark.redis
async def test_entries_expire_when_heartbeats_stop(redis_index: RedisIndex) -> None:
    record = ReplicaRecord(id="r1", model="m", block_size=16, ttl_s=0.2)
    service = RegistrationService(redis_index, [record], interval_s=0.05)
    await service.start()
    assert service._task is not None
    service._task.cancel()  # a crash: no deregistration
    await asyncio.sleep(0.4)
    assert [r.id for r in await redis_index.reap()] == ["r1"]
    assert await redis_index.replicas() == []


@pytest.mark.redis
async def test_redis_outage_is_survived_and_recovered() -> None:
    server = RedisServer().start()
    index = RedisIndex.from_url(server.url, timeout_s=0.3)
    record = ReplicaRecord(id="r1", model="m", block_size=16)
    service = RegistrationService(index, [record], interval_s=0.05)
    try:
        await service.start()
        assert service.registered
        server.stop()
        await until(lambda: _async(service.failures >= 2))
        assert not service.registered
        server.start()  # same port, empty data
        await until(lambda: _has(index, "r1"))
        assert service.registered
        await service.stop()
    finally:
        await index.close()
        server.close()


async def _async(value: bool) -> bool:
    return value


async def _has(index: RedisIndex, replica: str) -> bool:
    try:
        return replica in {r.id for r in await index.replicas()}
    except Exception:
        return False


class FakeVLLM:
    """Just ``GET /health``, switchable between 200 and 503."""

    def __init__(self) -> None:
        self.healthy = True
        self.app = Starlette(routes=[Route("/health", self.health)])

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)


@pytest.fixture
async def fake_vllm() -> AsyncIterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM()
    server = HTTPServer(fake.app, bind("127.0.0.1", 0), shutdown_timeout_s=1)
    await server.start()
    yield fake, f"http://127.0.0.1:{server.port}"
    await server.stop()


@pytest.mark.redis
async def test_attach_follows_vllm_health(
    redis_url: str, redis_index: RedisIndex, fake_vllm: tuple[FakeVLLM, str]
) -> None:
    fake, url = fake_vllm
    s = settings(redis=redis_url, url=url, heartbeat_s=0.05, ttl_s=5, down_after=2)
    stop = asyncio.Event()
    task = asyncio.create_task(attach(s, stop))
    await until(lambda: _has(redis_index, "r1"))
    (record,) = await redis_index.replicas()
    assert (record.url, record.events, record.replay) == (url, s.events, s.replay)
    fake.healthy = False
    await until(lambda: _async_not(_has(redis_index, "r1")))
    fake.healthy = True
    await until(lambda: _has(redis_index, "r1"))
    (again,) = await redis_index.replicas()
    assert again.instance != record.instance  # vLLM probably restarted: fence old blocks
    stop.set()
    await task
    assert await redis_index.replicas() == []


async def _async_not(value: Awaitable[bool]) -> bool:
    return not await value


def test_plugin_does_nothing_unless_configured() -> None:
    register({})  # no KVROUTER_ATTACH_REDIS: nothing happens
    # a child process of the server that already heartbeats
    register({"KVROUTER_ATTACH_REDIS": "redis://x", "KVROUTER_ATTACH_OWNER_PID": "1"})
    assert "KVROUTER_ATTACH_OWNER_PID" not in os.environ


@pytest.mark.redis
async def test_plugin_heartbeats_from_the_vllm_process(
    redis_url: str, redis_index: RedisIndex, fake_vllm: tuple[FakeVLLM, str]
) -> None:
    _, url = fake_vllm
    env = {
        **os.environ,
        "KVROUTER_ATTACH_REDIS": redis_url,
        "KVROUTER_ATTACH_ID": "plugin-r",
        "KVROUTER_ATTACH_URL": url,
        "KVROUTER_ATTACH_EVENTS": "tcp://127.0.0.1:5557",
        "KVROUTER_ATTACH_HEARTBEAT_S": "0.1",
        "KVROUTER_ATTACH_TTL_S": "1",
    }
    env.pop("KVROUTER_ATTACH_OWNER_PID", None)
    # what vLLM does in its API server and again in each child process it spawns
    code = (
        "import os, subprocess, sys, time\n"
        "from publishers.vllm import register\n"
        "register()\n"
        "assert os.environ['KVROUTER_ATTACH_OWNER_PID'] == str(os.getpid())\n"
        "child = 'from publishers.vllm import register; import threading; register();"
        " assert threading.active_count() == 1'\n"
        "subprocess.run([sys.executable, '-c', child], check=True)\n"
        "time.sleep(60)\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, env=env)
    try:
        await until(lambda: _has(redis_index, "plugin-r"), within=15)
        (record,) = await redis_index.replicas()
        assert (record.url, record.ttl_s) == (url, 1.0)
    finally:
        proc.kill()
        await proc.wait()
    await asyncio.sleep(1.2)
    assert [r.id for r in await redis_index.reap()] == ["plugin-r"]
