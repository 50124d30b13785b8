"""``kvrouter router`` as a real process: flags, bad settings, one-command embedded mode, drain."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from router.http.proxy import PREDICTED_HEADER
from tests.procs import KVROUTER, free_port, free_ports
from tests.router.harness import SYSTEM, Process, chat, wait_healthy

pytestmark = pytest.mark.timeout(60)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVROUTER), "router", *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_flags_come_from_the_settings() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for flag in ("--replica", "--redis", "--model", "--block-size", "--tokenizer", "--port"):
        assert flag in result.stdout
    assert "KVROUTER_ROUTER_LOOKUP_TIMEOUT_MS" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replica", "a=tcp://127.0.0.1:5557"], "url="),
        (["--replica", "nonsense"], "bad replica spec"),
        (["--api-key-file", "/nonexistent/keys", "--port", "0"], "cannot read"),
        (["--local-index", "--replica", "a=tcp://127.0.0.1:5557,url=http://x"], "needs --redis"),
        (["--local-index", "--redis", "redis://127.0.0.1:1"], "needs --replica"),
        (["--local-index", "--redis", "redis://x:1", "--load-refresh-ms", "-1"], "load-refresh"),
    ],
)
def test_bad_settings_exit_with_a_clear_message(args: list[str], message: str) -> None:
    result = _run(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


async def test_one_command_serves_with_an_embedded_tracker_and_drains(tmp_path: Path) -> None:
    http, events, replay, port = free_ports(2), free_ports(2), free_ports(2), free_port()
    replica = Process(
        [
            "replica", "--count", "2", "--port", str(http),
            "--events", f"tcp://*:{events}", "--replay", f"tcp://*:{replay}",
            "--model", "sim", "--time-scale", "0.01", "--floor-ms", "1000",
        ],
        tmp_path / "replica.log",
    )  # fmt: skip
    specs = [
        f"replica-{i}=tcp://127.0.0.1:{events + i},replay=tcp://127.0.0.1:{replay + i},"
        f"url=http://127.0.0.1:{http + i}"
        for i in range(2)
    ]
    args = ["router", "--port", str(port), "--model", "sim", "--log-format", "json"]
    for spec in specs:
        args += ["--replica", spec]
    router = Process(args, tmp_path / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(f"http://127.0.0.1:{http + 1}", replica)
        await wait_healthy(url, router)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            await client.post("/v1/chat/completions", json=chat(SYSTEM, "a"))
            second = await client.post("/v1/chat/completions", json=chat(SYSTEM, "b"))
            assert second.status_code == 200
            cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert int(second.headers[PREDICTED_HEADER]) == cached > 1000

            body = chat("short", "go", stream=True, max_tokens=120)
            lines: list[str] = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not lines:
                        router.signal(signal.SIGTERM)  # mid-stream: the stream must finish
                    if line:
                        lines.append(line)
        assert lines[-1] == "data: [DONE]"
        assert await router.wait() == 0
        records = [json.loads(line) for line in router.log().splitlines() if line.startswith("{")]
        drain = next(r for r in records if r["msg"] == "router draining")
        assert drain["inflight"] == 1
        stopped = next(r for r in records if r["msg"] == "router stopped")
        assert (stopped["drained"], stopped["cancelled"]) == (1, 0)
    finally:
        router.close()
        replica.close()
