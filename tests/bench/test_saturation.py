"""The saturation benchmark end to end on a tiny plan: the engines direct and two kvrouter
arms (one process, ``--workers 2``), then the gateway arms (Envoy with and without kvrouter
epp), real processes, every row filled."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.gateway import ENVOY, EPP
from bench.proxy_load import PATH, Bodies, Target
from bench.saturation import main, open_streams, render
from bench.stack.envoy import MISSING, envoy_binary

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


def test_a_tiny_run_measures_every_target_at_every_level(tmp_path: Path) -> None:
    out = tmp_path / "saturation.json"
    argv = ["--concurrency", "1,4", "--rates", "20", "--seconds", "0.6", "--rounds", "2"]
    argv += ["--workers", "1,2"]
    argv += ["--peers", "", "--epp", "", "--no-envoy"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    targets = report["targets"]
    assert set(targets) == {
        "direct",
        "kvrouter-w1",
        "kvrouter-w2",
        "kvrouter-local",
        "kvrouter-embedded",
    }
    for name, levels in targets.items():
        assert set(levels) == {"1", "4", "20/s"}
        for row in levels.values():
            assert row["errors"] == 0 and row["requests"] > 0, (name, row)
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"] <= row["ttft_p99_ms"]
            assert row["gap_p99_ms"] > 0  # 16-token streams: chunks apart
            if name != "direct":
                assert row["cpu_ms_per_request"] > 0  # read from the router's process tree
                assert "added_p50_ms" in row
    assert report["saturation"]["kvrouter-w2"] > 0
    assert "kvrouter-w2" in render(targets) and "kvrouter-embedded" in render(targets)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--concurrency", "0"])
    with pytest.raises(SystemExit):
        main(["--peers", "nginx"])
    with pytest.raises(SystemExit):
        main(["--rates", "0"])
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])


async def test_open_loop_arrivals_do_not_wait_for_answers() -> None:
    """Requests keep arriving at the offered rate while earlier ones are still streaming
    (a closed loop would send the next only after an answer), and every target of a level
    gets the same arrival times."""
    arrived: list[float] = []

    async def slow(request: web.Request) -> web.StreamResponse:
        arrived.append(asyncio.get_running_loop().time())
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.3)  # every answer outlives several arrivals
        await response.write(b'data: {"choices": []}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post(PATH, slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as client:
            target = Target("slow", [f"http://127.0.0.1:{port}"])
            level = await open_streams(
                client, target, Bodies(2), rate=40.0, seconds=0.5, output_tokens=4
            )
            first = list(arrived)
            arrived.clear()
            await open_streams(client, target, Bodies(2), rate=40.0, seconds=0.5, output_tokens=4)
    finally:
        await runner.cleanup()
    assert level.errors == 0 and len(level.ttft) == len(first) >= 8
    assert max(level.ttft) >= 0.3  # each answer took the server's 0.3 s
    assert first[-1] - first[0] < 0.5  # ... yet they all arrived within the level's 0.5 s
    assert len(arrived) == len(first)  # the same arrivals again


@pytest.mark.skipif(envoy_binary() is None, reason=MISSING)
def test_the_gateway_arms_report_the_pickers_and_envoys_cpu_apart(tmp_path: Path) -> None:
    """Envoy + kvrouter epp (every response chunk through the picker, or only the headers)
    and Envoy alone, end to end: each row filled, its CPU read per part."""
    out = tmp_path / "saturation.json"
    argv = ["--concurrency", "2", "--seconds", "0.4", "--rounds", "1", "--workers", ""]
    argv += ["--no-local-index", "--no-embedded", "--peers", "", "--json", str(out)]
    assert main(argv) == 0
    targets = json.loads(out.read_text())["targets"]
    assert set(targets) == {"direct", EPP, f"{EPP}-hdr", ENVOY}
    for name in (EPP, f"{EPP}-hdr", ENVOY):
        row = targets[name]["2"]
        assert row["errors"] == 0 and row["requests"] > 0, (name, row)
        assert row["requests"] / row["rps"] < 1.5  # the level's 0.4 s and the last streams
        assert row["cpu_envoy_ms_per_request"] > 0
        pickers = row.get("cpu_epp_ms_per_request", 0.0)
        assert (pickers > 0) == (name != ENVOY)
        assert row["cpu_ms_per_request"] == pytest.approx(row["cpu_envoy_ms_per_request"] + pickers)
    assert "epp" in render(targets) and "envoy" in render(targets)
