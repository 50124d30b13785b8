"""The attach shim that makes a real vLLM server visible to kvrouter; it holds no logic of its own.

vLLM already publishes the KV events kvrouter consumes (``--kv-events-config``); what it
lacks is a registry entry. Three ways to get one, all driven by :class:`AttachSettings`:

* :func:`vllm_flags` / :func:`vllm_env`: the exact flags and environment vLLM must run with;
* ``kvrouter attach``: a sidecar that heartbeats the entry while vLLM's ``/health`` answers;
* :func:`register`: a ``vllm.general_plugins`` entry point doing the same from inside vLLM,
  enabled by ``KVROUTER_ATTACH_REDIS`` (and the other ``KVROUTER_ATTACH_*`` variables).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import signal
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Final

import httpx
import msgspec

from publishers.config import AttachSettings, tcp_parts
from publishers.registration import HealthCheck, RegistrationService
from publishers.zmq import endpoint_for_rank
from tracker.core.backends import open_index
from tracker.core.index import BlockIndex, ReplicaRecord
from tracker.framework.errors import ConfigError
from tracker.framework.lifecycle import run_on_loop

logger = logging.getLogger(__name__)

OWNER_ENV: Final = "KVROUTER_ATTACH_OWNER_PID"
_plugin_lock = threading.Lock()
_plugin_started = False


def bind_endpoint(endpoint: str) -> str:
    """What vLLM binds for a connectable endpoint: ``tcp://host:5557`` -> ``tcp://*:5557``."""
    if endpoint.startswith("tcp://"):
        return f"tcp://*:{tcp_parts(endpoint, 'endpoint')[1]}"
    return endpoint


def kv_events_config(settings: AttachSettings) -> dict[str, Any]:
    """vLLM's ``--kv-events-config``; ``publisher`` is explicit for vLLM < 0.11.1."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": bind_endpoint(settings.events),
    }
    if settings.replay:
        config["replay_endpoint"] = bind_endpoint(settings.replay)
    config["topic"] = settings.topic
    return config


def vllm_flags(settings: AttachSettings) -> list[str]:
    """The ``vllm serve`` flags that make its KV events match what kvrouter expects."""
    flags = [
        "--enable-prefix-caching",
        "--block-size",
        str(settings.block_size),
        "--kv-events-config",
        json.dumps(kv_events_config(settings)),
    ]
    if settings.model != "default":
        flags += ["--served-model-name", settings.model]
    if settings.data_parallel_size > 1:
        flags += [
            "--data-parallel-size",
            str(settings.data_parallel_size),
            "--data-parallel-rank",
            str(settings.data_parallel_rank),
        ]
    return flags


def vllm_env(settings: AttachSettings) -> dict[str, str]:
    """Environment vLLM needs: a fixed PYTHONHASHSEED makes block hashes equal across replicas."""
    return {"PYTHONHASHSEED": settings.hash_seed}


def launch_line(settings: AttachSettings, model_path: str = "MODEL") -> str:
    """A copy-pasteable shell line: env, ``vllm serve``, flags."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in vllm_env(settings).items())
    flags = " ".join(shlex.quote(flag) for flag in vllm_flags(settings))
    return f"{env} vllm serve {shlex.quote(model_path)} {flags}"


def attach_record(settings: AttachSettings, instance: str) -> ReplicaRecord:
    """The registry entry for this server; endpoints carry the DP rank's port offset."""
    if settings.id is None:
        raise ConfigError("id is required")
    rank = settings.data_parallel_rank
    try:
        events = endpoint_for_rank(settings.events, rank)
        replay = endpoint_for_rank(settings.replay, rank) if settings.replay else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return ReplicaRecord(
        id=settings.id,
        model=settings.model,
        block_size=settings.block_size,
        url=settings.url,
        events=events,
        replay=replay,
        instance=instance,
        ttl_s=settings.ttl_s,
    )


def health_probe(client: httpx.AsyncClient, url: str) -> HealthCheck:
    """``GET {url}/health`` answered 200."""
    target = url.rstrip("/") + "/health"

    async def probe() -> bool:
        try:
            response = await client.get(target)
        except httpx.HTTPError as exc:
            logger.debug("health probe failed", extra={"url": target, "error": str(exc)})
            return False
        return response.status_code == 200

    return probe


def _fresh_instance(records: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
    # vLLM came back: it probably restarted, so its sequence numbers and blocks are new.
    instance = uuid.uuid4().hex
    return [msgspec.structs.replace(r, instance=instance) for r in records]


async def attach(
    settings: AttachSettings, stop: asyncio.Event, *, index: BlockIndex | None = None
) -> None:
    """Heartbeat the server's entry while it is healthy, until ``stop`` is set."""
    settings.require_attach()
    assert settings.redis is not None and settings.url is not None
    owned: BlockIndex | None = None
    if index is None:
        index = owned = open_index(settings.redis)
    timeout = httpx.Timeout(settings.health_timeout_s)
    async with httpx.AsyncClient(timeout=timeout) as client:
        service = RegistrationService(
            index,
            [attach_record(settings, uuid.uuid4().hex)],
            interval_s=settings.heartbeat_s,
            alive=health_probe(client, settings.url),
            down_after=settings.down_after,
            on_recover=_fresh_instance,
        )
        logger.info("attaching", extra={"replica": settings.id, "url": settings.url})
        await service.start()
        try:
            await stop.wait()
        finally:
            await service.stop()
            if owned is not None:
                await owned.close()


def run(settings: AttachSettings) -> int:
    """``kvrouter attach``: print the vLLM flags, or run the sidecar until SIGINT/SIGTERM."""
    if settings.print_flags:
        print(launch_line(settings))
        return 0
    settings.require_attach()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await attach(settings, stop)

    run_on_loop(main(), settings.loop)
    return 0


def register(environ: Mapping[str, str] | None = None) -> None:
    """vLLM general plugin: heartbeat this server from a daemon thread.

    vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (API
    server, engine cores, workers). Only the first process that loads it (the API server,
    which spawns the others) heartbeats; it marks itself in ``KVROUTER_ATTACH_OWNER_PID``,
    which the children inherit. Nothing happens unless ``KVROUTER_ATTACH_REDIS`` is set.
    """
    global _plugin_started  # noqa: PLW0603 - one heartbeat thread per process
    environ = os.environ if environ is None else environ
    if not environ.get(AttachSettings.env_name("redis")):
        return
    owner = environ.get(OWNER_ENV)
    if owner and owner != str(os.getpid()):
        return
    with _plugin_lock:
        if _plugin_started:
            return
        _plugin_started = True
    os.environ[OWNER_ENV] = str(os.getpid())
    try:
        settings = AttachSettings.from_env(environ)
        settings.require_attach()
    except ConfigError as exc:
        logger.error("kvrouter attach plugin disabled: %s", exc)
        return
    thread = threading.Thread(
        target=lambda: asyncio.run(attach(settings, asyncio.Event())),
        name="kvrouter-attach",
        daemon=True,
    )
    thread.start()
