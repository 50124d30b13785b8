"""A real Envoy (bench/stack/envoy.py) in front of simulated engines: every config variant
validates, the destination header routes, streams pass unbuffered, override_host falls back
down the list, FailOpen and FailClose, and what a picker learns of the endpoint that served."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import json_format

from bench.stack.envoy import (
    DESTINATION_HEADER,
    EXT_PROC_FILTER,
    LB_NAMESPACE,
    MISSING,
    SERVED_ATTRIBUTE,
    SERVED_KEY,
    EnvoyConfig,
    EnvoyProcess,
    ExtProc,
    Upstream,
    envoy_binary,
    validate,
)
from publishers.sim.server import ENGINE_HEADER
from tests.procs import KVROUTER, free_port, free_ports, wait_for_port

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason=MISSING)

MODEL = "sim"
STEP_MS = 50  # the engines' time per generated token: a stream visibly takes its time


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    """Two simulated engines (``replica-0``, ``replica-1``); their ``127.0.0.1:port``."""
    http, events, replay = free_ports(2), free_ports(2), free_ports(2)
    proc = subprocess.Popen(
        [
            str(KVROUTER), "replica", "--count", "2", "--port", str(http),
            "--events", f"tcp://*:{events}", "--replay", f"tcp://*:{replay}",
            "--model", MODEL, "--time-scale", "0.01", "--floor-ms", str(STEP_MS * 100),
            "--log-level", "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for i in range(2):
            wait_for_port(http + i, timeout=30)
        yield [f"127.0.0.1:{http + i}" for i in range(2)]
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture
def start_envoy(tmp_path: Path) -> Iterator[Callable[..., EnvoyProcess]]:
    """Start an Envoy for a config (ports filled in), stopped after the test."""
    started: list[EnvoyProcess] = []

    def start(**options: Any) -> EnvoyProcess:
        config = EnvoyConfig(port=free_port(), admin_port=free_port(), **options)
        envoy = EnvoyProcess(config, tmp_path / f"envoy-{len(started)}")
        started.append(envoy)
        return envoy.start()

    yield start
    for envoy in started:
        envoy.stop()


def completion(url: str, headers: dict[str, str], **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": "a prompt", "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)


def refused() -> str:
    """A loopback address nothing listens on (connections are refused)."""
    return f"127.0.0.1:{free_port()}"


VARIANTS: dict[str, dict[str, Any]] = {
    "original_dst": {},
    "override_host": {"upstream": Upstream.OVERRIDE_HOST, "engines": ("127.0.0.1:8001",)},
    "override_host_from_metadata": {
        "upstream": Upstream.OVERRIDE_HOST,
        "engines": ("10.0.0.1:8000", "10.0.0.2:8000"),
        "override_sources": ("metadata", "header"),
    },
    "ext_proc_tls_two_pickers": {"ext_proc": ExtProc(epps=("127.0.0.1:9002", "127.0.0.2:9002"))},
    "ext_proc_by_name_buffered": {
        "upstream": Upstream.OVERRIDE_HOST,
        "engines": ("127.0.0.1:8001",),
        "ext_proc": ExtProc(
            epps=("epp.example:9002",),
            tls=False,
            failure_mode_allow=True,
            request_body_mode="BUFFERED",
            request_trailer_mode="SKIP",
            graceful_close=True,
        ),
    },
    "ext_proc_subset_hint_health_checked": {
        "ext_proc": ExtProc(
            epps=("127.0.0.1:9002",),
            subset_hint_header="x-subset",
            health_check_interval_s=0.5,
            grpc_retries=0,
        ),
    },
    "ext_proc_response_streamed": {
        "ext_proc": ExtProc(
            epps=("127.0.0.1:9002",),
            response_body_mode="FULL_DUPLEX_STREAMED",
            response_trailer_mode="SEND",
        ),
    },
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_validates(name: str, tmp_path: Path) -> None:
    config = EnvoyConfig(port=10_000, admin_port=10_001, **VARIANTS[name])
    path = config.write(tmp_path / "envoy.json")
    assert json.loads(path.read_text()) == config.bootstrap()
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bad_options_are_refused_before_envoy_sees_them() -> None:
    with pytest.raises(ValueError, match="trailers SEND"):
        ExtProc(epps=("127.0.0.1:9002",), request_trailer_mode="SKIP")
    with pytest.raises(ValueError, match="engines"):
        EnvoyConfig(port=1, admin_port=2, upstream=Upstream.OVERRIDE_HOST)
    with pytest.raises(ValueError, match="host:port"):
        ExtProc(epps=("9002",))


def test_the_header_picks_the_engine(
    engines: list[str], start_envoy: Callable[..., EnvoyProcess]
) -> None:
    envoy = start_envoy()
    for i in (1, 0, 1):
        answer = completion(envoy.url, {DESTINATION_HEADER: engines[i]})
        assert answer.status_code == 200, answer.text
        assert answer.headers[ENGINE_HEADER] == f"replica-{i}"


def test_a_stream_passes_chunk_by_chunk(
    engines: list[str], start_envoy: Callable[..., EnvoyProcess]
) -> None:
    envoy = start_envoy()
    body = {"model": MODEL, "prompt": "a prompt", "max_tokens": 8, "stream": True}
    arrivals: list[float] = []
    with httpx.stream(
        "POST",
        f"{envoy.url}/v1/completions",
        json=body,
        headers={DESTINATION_HEADER: engines[1]},
        timeout=10,
    ) as answer:
        assert answer.headers[ENGINE_HEADER] == "replica-1"
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) >= 8
    # each token's chunk came as it was made (one engine step apart), not all at the end
    assert arrivals[-1] - arrivals[0] > 4 * STEP_MS / 1000


def test_override_host_tries_the_list_in_order(
    engines: list[str], start_envoy: Callable[..., EnvoyProcess]
) -> None:
    dead = refused()
    envoy = start_envoy(upstream=Upstream.OVERRIDE_HOST, engines=(dead, *engines))
    for first, second in ((0, 1), (1, 0)):
        answer = completion(envoy.url, {DESTINATION_HEADER: f"{engines[first]},{engines[second]}"})
        assert answer.headers[ENGINE_HEADER] == f"replica-{first}"
    answer = completion(envoy.url, {DESTINATION_HEADER: f"{dead},{engines[1]}"})
    assert answer.status_code == 200, answer.text
    assert answer.headers[ENGINE_HEADER] == "replica-1"
    assert (
        envoy.stats("cluster.engines.upstream_rq_retry")["cluster.engines.upstream_rq_retry"] == 1
    )


@pytest.mark.parametrize("fail_open", [True, False])
def test_an_unreachable_picker_fails_open_or_closed(
    fail_open: bool, engines: list[str], start_envoy: Callable[..., EnvoyProcess]
) -> None:
    # FailOpen with a BUFFERED body: Envoy still holds the body when the picker's error comes.
    # With FULL_DUPLEX_STREAMED, once any body went to the picker Envoy fails closed anyway
    # (ext_proc.cc, Filter::failureModeAllow), and the body usually goes before the error.
    body_mode = "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED"
    ext_proc = ExtProc(
        epps=(refused(),),
        tls=False,
        failure_mode_allow=fail_open,
        request_body_mode=body_mode,
        request_trailer_mode="SKIP" if fail_open else "SEND",
    )
    envoy = start_envoy(ext_proc=ext_proc)
    for _ in range(3):
        started = time.monotonic()
        answer = completion(envoy.url, {DESTINATION_HEADER: engines[0]})
        if fail_open:
            assert answer.status_code == 200, answer.text
            assert answer.headers[ENGINE_HEADER] == "replica-0"
        else:
            assert answer.status_code >= 500
            assert time.monotonic() - started < 3


class RecordingPicker(ext_proc_grpc.ExternalProcessorServicer):
    """A stand-in endpoint picker: sends every request to ``destination`` (header and
    ``envoy.lb`` metadata, once the request body ended) and records what Envoy sent it."""

    def __init__(self, destination: str) -> None:
        self.destination = destination
        self.received: list[ext_proc_pb2.ProcessingRequest] = []
        self.done = threading.Event()

    def _route(self) -> ext_proc_pb2.ProcessingResponse:
        header = base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=self.destination.encode())
        common = ext_proc_pb2.CommonResponse(
            clear_route_cache=True,
            header_mutation=ext_proc_pb2.HeaderMutation(
                set_headers=[base_pb2.HeaderValueOption(header=header)]
            ),
        )
        answer = ext_proc_pb2.ProcessingResponse(
            request_headers=ext_proc_pb2.HeadersResponse(response=common)
        )
        answer.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: self.destination}})
        return answer

    def Process(
        self, request_iterator: Iterator[ext_proc_pb2.ProcessingRequest], context: Any
    ) -> Iterator[ext_proc_pb2.ProcessingResponse]:
        context.add_callback(self.done.set)
        body = b""
        for request in request_iterator:
            self.received.append(request)
            kind = request.WhichOneof("request")
            if kind == "request_body":
                body += request.request_body.body
                if request.request_body.end_of_stream:
                    yield self._route()
                    streamed = ext_proc_pb2.StreamedBodyResponse(body=body, end_of_stream=True)
                    mutation = ext_proc_pb2.BodyMutation(streamed_response=streamed)
                    yield ext_proc_pb2.ProcessingResponse(
                        request_body=ext_proc_pb2.BodyResponse(
                            response=ext_proc_pb2.CommonResponse(body_mutation=mutation)
                        )
                    )
            elif kind == "response_headers":
                yield ext_proc_pb2.ProcessingResponse(
                    response_headers=ext_proc_pb2.HeadersResponse()
                )


@pytest.fixture
def picker() -> Iterator[tuple[RecordingPicker, str]]:
    servicer = RecordingPicker(destination="")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_the_picker_learns_which_endpoint_served(
    engines: list[str],
    start_envoy: Callable[..., EnvoyProcess],
    picker: tuple[RecordingPicker, str],
) -> None:
    servicer, address = picker
    dead = refused()
    servicer.destination = f"{dead},{engines[1]}"
    envoy = start_envoy(
        upstream=Upstream.OVERRIDE_HOST,
        engines=(dead, *engines),
        ext_proc=ExtProc(epps=(address,), tls=False),
    )
    answer = completion(envoy.url, {})
    assert answer.status_code == 200, answer.text
    assert answer.headers[ENGINE_HEADER] == "replica-1"
    assert servicer.done.wait(5)

    first = servicer.received[0]
    assert first.WhichOneof("request") == "request_headers"
    assert json_format.MessageToDict(first.protocol_config) == {
        "requestBodyMode": "FULL_DUPLEX_STREAMED"  # NONE, the response's, is the default
    }
    response_side = [r for r in servicer.received if r.HasField("response_headers")]
    assert len(response_side) == 1
    lb = json_format.MessageToDict(response_side[0].metadata_context)["filterMetadata"]
    # override_host's selected_host_key: the endpoint after the retry, not the first pick
    assert lb[LB_NAMESPACE][SERVED_KEY] == engines[1]
    attributes = json_format.MessageToDict(response_side[0].attributes[EXT_PROC_FILTER])
    assert attributes[SERVED_ATTRIBUTE] == engines[1]
