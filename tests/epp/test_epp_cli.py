"""``kvrouter epp`` as a real process: its flags, bad settings, and a graceful stop that lets
a stream in flight finish."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.epp import extproc
from tests.epp.extproc import Gateway, chat_body, destination, request_body, request_headers
from tests.procs import KVROUTER, free_port, free_ports
from tests.router.harness import SYSTEM, Process, chat, wait_healthy
from tracker.framework.cli import main

pytestmark = pytest.mark.timeout(60)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVROUTER), "epp", *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_flags_are_the_routers_and_the_pickers_own() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for flag in ("--grpc-port", "--health-port", "--tls-cert", "--tls-key", "--no-secure-serving"):
        assert flag in result.stdout
    for flag in ("--redis", "--replica", "--model", "--block-size", "--tokenizer", "--retries"):
        assert flag in result.stdout
    assert "KVROUTER_EPP_REDIS" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert", "/etc/hostname"], "tls-cert and tls-key go together"),
        (["--tls-cert", "a", "--tls-key", "b", "--no-secure-serving"], "turns TLS off"),
        (["--workers", "2", "--redis", "redis://127.0.0.1:1"], "more endpoint-picker replicas"),
        (["--grpc-port", "70000"], "grpc-port must be a TCP port"),
        (["--max-streams", "0"], "max-streams must be positive"),
    ],
)
def test_bad_settings_exit_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["epp", *args])  # the command line's own parser, in this process
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("--grpc-port", str(port), "--port", "0", "--health-port", "0")
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


async def test_a_stop_lets_the_stream_in_flight_finish(tmp_path: Path) -> None:
    http, events, replay = free_ports(2), free_ports(2), free_ports(2)
    port, grpc_port, health_port = free_port(), free_port(), free_port()
    replica = Process(
        [
            "replica", "--count", "2", "--port", str(http),
            "--events", f"tcp://*:{events}", "--replay", f"tcp://*:{replay}",
            "--model", "sim", "--time-scale", "0.01",
        ],
        tmp_path / "replica.log",
    )  # fmt: skip
    args = [
        "epp", "--port", str(port), "--grpc-port", str(grpc_port),
        "--health-port", str(health_port), "--model", "sim", "--log-format", "json",
    ]  # fmt: skip
    for i in range(2):
        args += [
            "--replica",
            f"replica-{i}=tcp://127.0.0.1:{events + i},replay=tcp://127.0.0.1:{replay + i},"
            f"url=http://127.0.0.1:{http + i}",
        ]
    picker = Process(args, tmp_path / "epp.log")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{health_port}")
    gateway: Gateway | None = None
    try:
        await wait_healthy(f"http://127.0.0.1:{http + 1}", replica)
        await wait_healthy(f"http://127.0.0.1:{port}", picker)
        # TLS on the ext_proc port (a self-signed certificate made at start): read it off the
        # port, as a gateway that does not verify it would take it
        certificate = extproc.server_certificate(grpc_port)
        gateway = Gateway(grpc_port, certificate=certificate)
        stream = gateway.stream()
        body = chat_body(**chat(SYSTEM, "hello", stream=True))
        await stream.send(request_headers(), request_body(body, end=True))
        served = destination((await stream.read(2))[0]).split(",")[0]
        await stream.send(extproc.response_headers(served=served))
        await stream.read(1)

        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="readiness"))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        picker.signal(signal.SIGTERM)  # mid-response: the probes say so, the stream goes on
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stream.send(extproc.response_body(b"data: [DONE]\n\n", end=True))
        await stream.read(1)  # still answered while draining
        await stream.end()
        assert await picker.wait() == 0
        records = [json.loads(line) for line in picker.log().splitlines() if line.startswith("{")]
        stopped = next(r for r in records if r["msg"] == "endpoint picker stopped")
        assert (stopped["drained"], stopped["cut"]) == (1, 0)
    finally:
        await channel.close()
        if gateway is not None:
            await gateway.close()
        picker.close()
        replica.close()
