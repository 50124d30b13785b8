"""``kvrouter epp`` over a real gRPC stream, spoken to as Envoy's ext_proc filter does.

Simulated engines behind it with the embedded tracker: the picks, the order and size of the
answers, the subset hint, the errors, and the books each request leaves (its load lease is
released however the stream ends).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.config import EppSettings
from router.epp.service import EppService
from router.epp.tls import self_signed
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
    loads = service.router.load.current(namespace) or {}
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


def address(fleet: Engines, i: int) -> str:
    return fleet.url(i).removeprefix("http://")


def refusal(answer: Any) -> tuple[int, dict[str, Any]]:
    """An ``ImmediateResponse``'s status and its OpenAI error."""
    immediate = answer.immediate_response
    assert answer.HasField("immediate_response"), answer
    return int(immediate.status.code), msgspec.json.decode(immediate.body)["error"]


async def send_request(
    gateway: Gateway, body: bytes, **headers: Any
) -> tuple[extproc.Stream, list[Any]]:
    """Headers and the whole body (in one chunk) of a full-duplex request; the answers up to
    the end of the echoed body (or the refusal)."""
    stream = gateway.stream()
    await stream.send(request_headers(**headers), request_body(body, end=True))
    first = await stream.read(1)
    if first[0].HasField("immediate_response"):
        return stream, first
    rest = []
    while not (rest and extproc.streamed(rest)[1]):
        rest += await stream.read(1)
    return stream, first + rest


async def test_buffered_mode_takes_the_pick_on_the_body_answer() -> None:
    async with engines(2) as fleet, picker(fleet) as (_, gateway):
        body = chat_body(**chat(SYSTEM, "hello"))
        stream = gateway.stream()
        await stream.send(request_headers(mode=extproc.BUFFERED))
        (headers,) = await stream.read(1)  # answered before the gateway sends the body
        assert headers.HasField("request_headers")
        assert not headers.request_headers.response.header_mutation.set_headers
        await stream.send(request_body(body, end=True))
        (answer,) = await stream.read(1)
        assert answer.HasField("request_body")
        assert destination(answer).split(",")[0] in (address(fleet, 0), address(fleet, 1))
        assert not answer.request_body.response.HasField("body_mutation")  # body unchanged
        stream.cancel()


async def test_a_large_body_comes_back_whole_in_chunks_of_at_most_62000_bytes() -> None:
    async with engines(2) as fleet, picker(fleet) as (_, gateway):
        body = chat_body(**chat(SYSTEM, "x " * 100_000))
        stream = gateway.stream()
        await stream.send(request_headers())
        for start in range(0, len(body), 16_384):  # as Envoy streams it
            chunk = body[start : start + 16_384]
            await stream.send(request_body(chunk, end=start + 16_384 >= len(body)))
        answers, echoed = await stream.read(1), []
        destination(answers[0])
        while not (echoed and extproc.streamed(echoed)[1]):
            echoed += await stream.read(1)
        sizes = [len(a.request_body.response.body_mutation.streamed_response.body) for a in echoed]
        assert max(sizes) <= 62_000 and len(sizes) == -(-len(body) // 62_000)
        assert extproc.streamed(echoed) == (body, True)
        stream.cancel()


async def test_the_subset_hint_and_the_conformance_header_restrict_the_pick() -> None:
    async with engines(2) as fleet, picker(fleet) as (_, gateway):
        body = chat_body(**chat(SYSTEM, "hello"))
        for i in (0, 1):
            stream, answers = await send_request(gateway, body, subset=[address(fleet, i)])
            assert destination(answers[0]) == address(fleet, i)  # no fallback outside it
            stream.cancel()
        selection = {"test-epp-endpoint-selection": "127.0.0.1"}  # a bare IP: every port
        stream, answers = await send_request(gateway, body, extra=selection)
        assert len(destination(answers[0]).split(",")) == 2
        stream.cancel()
        stream, answers = await send_request(gateway, body, subset=["10.9.9.9:8000"])
        status, error = refusal(answers[0])
        assert status == 503 and error["code"] == "no_replica_available"
        assert await stream.closed()


async def test_a_session_header_keeps_unrelated_prompts_on_one_endpoint() -> None:
    """The picker reads ``--session-header`` as the proxy does: a session's requests follow
    its first even when they share no block (key-less, they are spread)."""
    async with engines(3) as fleet, picker(fleet) as (_, gateway):
        picked: dict[str, set[str]] = {"": set(), "agent-1": set()}
        for i in range(12):
            session = "agent-1" if i % 2 else ""
            body = chat_body(**chat(f"{i} " * 100 + SYSTEM, "hello"))
            extra = {"x-session-id": session} if session else {}
            stream, answers = await send_request(gateway, body, extra=extra)
            picked[session].add(destination(answers[0]).split(",")[0])
            stream.cancel()
        assert len(picked["agent-1"]) == 1 and len(picked[""]) >= 2, picked


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "sim", "messages": [{"role": "user", "con', 400, None),
        (b'{"model": "sim", "messages": "not a list"}', 400, "messages"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
        (b"[1, 2]", 400, None),
    ],
)
async def test_bad_bodies_are_refused_in_the_openai_shape(
    body: bytes, status: int, param: str | None
) -> None:
    async with engines(2) as fleet, picker(fleet) as (service, gateway):
        stream, answers = await send_request(gateway, body)
        got, error = refusal(answers[0])
        assert (got, error["param"]) == (status, param), error
        assert await stream.closed()
        assert not inflight(service)
        # the picker goes on serving
        stream, answers = await send_request(gateway, chat_body(**chat(SYSTEM, "fine")))
        destination(answers[0])
        stream.cancel()


async def test_a_body_over_the_limit_is_refused_413_before_it_is_all_read() -> None:
    async with engines(2) as fleet, picker(fleet, max_body_bytes=100_000) as (_, gateway):
        stream = gateway.stream()
        await stream.send(request_headers())
        chunk = b"x" * 60_000
        await stream.send(request_body(chunk, end=False), request_body(chunk, end=False))
        status, error = refusal((await stream.read(1))[0])
        assert status == 413 and "100000" in error["message"]
        assert await stream.closed()


async def test_an_api_key_is_required_when_configured() -> None:
    async with engines(2) as fleet, picker(fleet, api_key="sesame") as (_, gateway):
        body = chat_body(**chat(SYSTEM, "hello"))
        stream, answers = await send_request(gateway, body)
        assert refusal(answers[0])[0] == 401
        authorized = {"authorization": "Bearer sesame"}
        stream, answers = await send_request(gateway, body, extra=authorized)
        destination(answers[0])
        stream.cancel()


async def test_a_request_without_a_body_is_placed_on_load() -> None:
    async with engines(2) as fleet, picker(fleet) as (_, gateway):
        picked = set()
        for _ in range(4):
            stream = gateway.stream()
            await stream.send(request_headers("/v1/models", end=True))
            picked.add(destination((await stream.read(1))[0]))
            stream.cancel()
        assert picked == {address(fleet, 0), address(fleet, 1)}  # in turn


async def test_trailers_end_the_body_and_are_answered_after_it() -> None:
    async with engines(2) as fleet, picker(fleet) as (_, gateway):
        body = chat_body(**chat(SYSTEM, "hello"))
        stream = gateway.stream()
        trailers = extproc.pb.ProcessingRequest(request_trailers=extproc.pb.HttpTrailers())
        await stream.send(request_headers(), request_body(body, end=False), trailers)
        answers = await stream.read(3)
        destination(answers[0])
        assert extproc.streamed(answers[1:2]) == (body, False)
        assert answers[2].HasField("request_trailers")
        stream.cancel()


async def test_the_served_endpoint_takes_the_load_after_a_gateway_retry() -> None:
    async with engines(2) as fleet, picker(fleet) as (service, gateway):
        stream, answers = await send_request(gateway, chat_body(**chat(SYSTEM, "hi", stream=True)))
        first, fallback = destination(answers[0]).split(",")
        picked = replica_at(fleet, first)
        other = "replica-1" if picked == "replica-0" else "replica-0"
        assert inflight(service) == {picked: 1}
        await stream.send(extproc.response_headers(served=fallback))
        (headers,) = await stream.read(1)
        assert extproc.set_headers(headers, "response_headers")["x-kvrouter-replica"] == other
        assert inflight(service) == {other: 1}
        assert service.router is not None
        rerouted = service.router.metrics.epp_reroutes.labels(picked)
        assert rerouted._value.get() == 1  # type: ignore[attr-defined]
        stream.cancel()  # the client left mid-stream
        await wait_until(lambda: not inflight(service), within=5)


def replica_at(fleet: Engines, address_: str) -> str:
    return next(f"replica-{i}" for i in range(fleet.count) if address(fleet, i) == address_)


async def test_a_non_streamed_answer_reports_the_engines_cached_tokens() -> None:
    async with engines(2) as fleet, picker(fleet) as (service, gateway):
        stream, answers = await send_request(gateway, chat_body(**chat(SYSTEM, "hi")))
        served = destination(answers[0]).split(",")[0]
        await stream.send(extproc.response_headers(served=served, sse=False))
        await stream.read(1)
        usage = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
        answer = msgspec.json.encode({"choices": [], "usage": usage})
        await stream.send(extproc.response_body(answer, end=True))
        await stream.read(1)
        await stream.end()
        assert service.router is not None
        replica = replica_at(fleet, served)
        engine = service.router.metrics.engine_cached.labels(replica)
        await wait_until(lambda: engine._value.get() == 32, within=5)  # type: ignore[attr-defined]
        assert not inflight(service)


async def test_requests_are_shed_with_429_when_every_replica_is_full() -> None:
    async with engines(2) as fleet, picker(fleet, shed_inflight=1) as (service, gateway):
        held = []
        for i in range(2):  # one request on each replica
            body = chat_body(**chat(SYSTEM, "hello"))
            stream, answers = await send_request(gateway, body, subset=[address(fleet, i)])
            destination(answers[0])
            held.append(stream)
        assert sorted(inflight(service).values()) == [1, 1]
        stream, answers = await send_request(gateway, chat_body(**chat(SYSTEM, "three")))
        status, error = refusal(answers[0])
        assert status == 429 and error["type"] == "rate_limit_error"
        for stream in held:
            stream.cancel()
        await wait_until(lambda: not inflight(service), within=5)


async def test_health_says_serving_for_every_service_until_it_stops() -> None:
    # the health port speaks plaintext (the kubelet's gRPC probes) beside a TLS ext_proc port
    async with engines(2) as fleet:
        service = EppService(epp_settings(fleet, secure_serving=True))
        await service.start()
        assert service.health_port is not None
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.health_port}")
        stub = health_pb2_grpc.HealthStub(channel)
        names = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
        try:
            for name in names:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stopping = asyncio.ensure_future(service.stop())
            reply = await asyncio.wait_for(watch.read(), 5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await stopping
        finally:
            await channel.close()
            await service.stop()


async def test_tls_with_a_given_certificate(tmp_path: Path) -> None:
    certificate, key = self_signed()
    (tmp_path / "tls.crt").write_bytes(certificate)
    (tmp_path / "tls.key").write_bytes(key)
    async with engines(2) as fleet:
        files = {"tls_cert": str(tmp_path / "tls.crt"), "tls_key": str(tmp_path / "tls.key")}
        async with picker(fleet, secure_serving=True, **files) as (service, _):
            assert service.grpc_port is not None
            gateway = Gateway(service.grpc_port, certificate=certificate)
            try:
                stream, answers = await send_request(gateway, chat_body(**chat(SYSTEM, "hi")))
                destination(answers[0])
                stream.cancel()
            finally:
                await gateway.close()


async def test_with_the_response_body_skipped_a_request_counts_until_its_expected_first_token() -> (
    None
):
    # Envoy closes the stream once the response headers are answered when the response body
    # is not sent: the generation's end is never seen, its prefill is expected to take 400 ms
    async with engines(2) as fleet, picker(fleet, prefill_floor_ms=400.0) as (service, gateway):
        body = chat_body(**chat(SYSTEM, "hi", stream=True))
        stream = gateway.stream()
        await stream.send(
            request_headers(response_mode=extproc.Mode.NONE), request_body(body, end=True)
        )
        answers = await stream.read(2)
        served = destination(answers[0]).split(",")[0]
        await stream.send(extproc.response_headers(served=served))
        await stream.read(1)
        await stream.end()
        assert await stream.closed()
        await asyncio.sleep(0.1)
        assert inflight(service) == {replica_at(fleet, served): 1}
        await wait_until(lambda: not inflight(service), within=5)
