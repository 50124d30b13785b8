"""Safe defaults: every command listens on loopback unless told otherwise, secrets stay masked."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import zmq
import zmq.asyncio

from publishers.config import ReplicaSettings
from publishers.sim.fleet import FleetService
from tests.procs import free_port
from tracker.core.event_codec import decode_batch
from tracker.core.events import decode_message
from tracker.framework.cli import load_commands

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def _defaults() -> list[tuple[str, str, Any]]:
    out = []
    for command in load_commands().values():
        for field in dataclasses.fields(command.settings):  # type: ignore[arg-type]
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                continue
            out.append((command.name, field.name, default))
    return out


def _host(address: str) -> str | None:
    return urlsplit(address).hostname


def test_every_listening_or_connecting_default_is_loopback() -> None:
    checked = []
    for command, name, default in _defaults():
        values = default if isinstance(default, tuple) else (default,)
        for value in values:
            if name == "bind" or name.endswith("_host") or name == "host":
                assert value is None or value in LOOPBACK, (command, name, value)
                checked.append((command, name))
            elif (command, name) == ("replica", "events"):
                # vLLM's own default and bind rule: a PUB endpoint binds only on a wildcard
                # (any other address, loopback included, connects out); loopback-only
                # deployments point it at a tracker's --bind instead (the test below)
                assert value == "tcp://*:5557", value
                checked.append((command, name))
            elif isinstance(value, str) and "://" in value:
                assert _host(value) in LOOPBACK, (command, name, value)
                checked.append((command, name))
    # the ones that matter are really there (a rename must not make this test vacuous)
    for expected in [
        ("router", "host"),
        ("tracker", "http_host"),
        ("tracker", "bind"),
        ("replica", "host"),
        ("replica", "events"),
        ("replica", "replay"),
        ("replica", "advertise_host"),
        ("attach", "events"),
        ("lookup", "redis"),
    ]:
        assert expected in checked, expected


def test_wildcard_endpoints_still_bind_when_given() -> None:
    settings = ReplicaSettings(events="tcp://*:5557", replay="tcp://*:5558")
    assert settings.events == "tcp://*:5557"
    assert settings.replay == "tcp://*:5558"


@pytest.mark.timeout(30)
async def test_a_replica_on_loopback_connects_out_and_listens_on_loopback_only(
    zctx: zmq.asyncio.Context,
) -> None:
    """vLLM's rule: a loopback PUB endpoint is connected to, as a tracker's ``--bind``."""
    http, events, replay = free_port(), free_port(), free_port()
    settings = ReplicaSettings(
        port=http,
        events=f"tcp://127.0.0.1:{events}",
        replay=f"tcp://127.0.0.1:{replay}",
        time_scale=0.01,
        num_blocks=256,
    )
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{events}")  # where the tracker's --bind would listen
    fleet = FleetService(settings)
    await fleet.start()
    try:
        replica = fleet.replicas[0]
        assert replica.server.sock.getsockname()[0] == "127.0.0.1"
        # the PUB socket connected out: a consumer has nothing to connect to
        assert replica.record.events is None
        assert replica.record.replay == f"tcp://127.0.0.1:{replay}"
        for port in (replay, http):  # nothing listens on another address
            with socket.socket() as probe:
                probe.settimeout(0.5)
                assert probe.connect_ex((_non_loopback_address(), port)) != 0
        received: list[bytes] | None = None
        async with httpx.AsyncClient(base_url=replica.record.url or "", timeout=5) as client:
            for attempt in range(50):  # the PUB connects asynchronously: ask until one arrives
                prompt = f"request {attempt}: " + "a fairly long prompt " * 20
                answer = await client.post("/v1/completions", json={"prompt": prompt})
                assert answer.status_code == 200, answer.text
                try:
                    async with asyncio.timeout(0.2):
                        received = await sub.recv_multipart()
                    break
                except TimeoutError:
                    continue
        assert received is not None, "no event reached the loopback SUB"
        decode_batch(decode_message(received).payload)
    finally:
        sub.close(linger=0)
        await fleet.stop()


def _non_loopback_address() -> str:
    """An address of this machine that is not loopback (skips the test when there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
            address = str(probe.getsockname()[0])
        except OSError:
            address = ""
    if not address or address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    return address
