"""``kvrouter epp`` over a real gRPC stream, spoken to as Envoy's ext_proc filter does.

Simulated engines behind it with the embedded tracker: the picks, the order and size of the
answers, the subset hint, the errors, and the books each request leaves (its load lease is
released however the stream ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.config import EppSettings
from router.epp.service import EppService
from tests.epp import extproc
from tests.epp.extproc import Gateway, chat_body, destination, request_body, request_headers
from tests.router.harness import SYSTEM, Engines, chat, engines, wait_until
from tracker.core.blocks import Namespace

pytestmark = pytest.mark.asyncio


def epp_settings(fleet: Engines, **overrides: Any) -> EppSettings:
    options: dict[str, Any] = {
        "port": 0,
        "grpc_port": 0,
        "health_port": 0,
        "secure_serving": False,
        "model": "sim",
        "replica": fleet.specs,
        "health_interval_s": 0.2,
        "health_timeout_s": 0.5,
        "metrics_interval_s": 0.2,
        "shutdown_timeout_s": 2.0,
    }
    options.update(overrides)
    return EppSettings(**options)


@contextlib.asynccontextmanager
async def picker(fleet: Engines, **overrides: Any) -> AsyncIterator[tuple[EppService, Gateway]]:
    service = EppService(epp_settings(fleet, **overrides))
    await service.start()
    assert service.grpc_port is not None
    gateway = Gateway(service.grpc_port)
    try:
        yield service, gateway
    finally:
        await gateway.close()
        await service.stop()


def inflight(service: EppService) -> dict[str, int]:
    """Requests in flight per replica, as this picker's load board holds them."""
    assert service.router is not None
    namespace = Namespace("sim", service.settings.block_size)
    loads = service.router.load.current(namespace)
    return {replica: load.inflight for replica, load in loads.items() if load.inflight}


async def test_a_chat_request_is_picked_echoed_and_released() -> None:
    async with engines(2) as fleet, picker(fleet) as (service, gateway):
        body = chat_body(**chat(SYSTEM, "hello", stream=True))
        stream = gateway.stream()
        await stream.send(request_headers(), request_body(body[:100], end=False))
        await stream.send(request_body(body[100:], end=True))
        answers = await stream.read(2)
        picked = destination(answers[0])
        addresses = [fleet.url(i).removeprefix("http://") for i in range(2)]
        assert picked.split(",")[0] in addresses and len(picked.split(",")) == 2
        assert extproc.streamed(answers[1:]) == (body, True)
        assert sum(inflight(service).values()) == 1
        await stream.send(extproc.response_headers(served=picked.split(",")[0]))
        (headers,) = await stream.read(1)
        receipt = extproc.set_headers(headers, "response_headers")
        assert receipt["x-kvrouter-replica"] in ("replica-0", "replica-1")
        data = b'data: {"choices":[{"text":"x"}]}\n\n'
        await stream.send(extproc.response_body(data, end=False))
        assert extproc.streamed(await stream.read(1), "response_body") == (data, False)
        await stream.send(extproc.response_body(b"data: [DONE]\n\n", end=True))
        await stream.read(1)
        await stream.end()
        await wait_until(lambda: not inflight(service), within=5)
