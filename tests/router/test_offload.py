"""Offload tiers end to end: engines with a CPU tier behind a small GPU cache, the tracker and
a router on one redis-server, as real processes.

A prompt the GPU pool evicted lives on in the engine's CPU tier (vLLM's offloading connector
announces it with ``medium="CPU"``). ``/index`` must say so, the router must count it as a hit
that loads rather than recomputes, and its prediction must equal the tokens the engine reports
cached (GPU hits plus what it loaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.procs import free_port, free_ports
from tests.router.harness import Process, wait_healthy, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]
BLOCK = 16


def _prompt(seed: str) -> str:
    """~600 tokens (the builtin tokenizer: one per character): 37 blocks of a 64-block cache."""
    return (seed * 600)[:600]


async def _complete(client: httpx.AsyncClient, prompt: str) -> tuple[str, int, int]:
    answer = await client.post(
        "/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 2}
    )
    assert answer.status_code == 200, answer.text
    cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return answer.headers[REPLICA_HEADER], int(answer.headers[PREDICTED_HEADER]), cached


async def test_a_prefix_evicted_to_the_cpu_tier_is_shown_and_routed_as_a_loading_hit(
    redis_url: str, tmp_path: Path
) -> None:
    http, events, replay = free_ports(2), free_ports(2), free_ports(2)
    replica = Process(
        [
            "replica", "--count", "2", "--port", str(http),
            "--events", f"tcp://*:{events}", "--replay", f"tcp://*:{replay}",
            "--model", "sim", "--redis", redis_url, "--time-scale", "0.01",
            "--num-blocks", "64", "--offload-blocks", "256",
            "--heartbeat-s", "0.5", "--ttl-s", "3",
        ],
        tmp_path / "replica.log",
    )  # fmt: skip
    tracker = Process(["tracker", "--redis", redis_url, "--http-port", "0"], tmp_path / "t.log")
    port = free_port()
    router = Process(
        [
            "router", "--port", str(port), "--redis", redis_url, "--predict-ttl-s", "0",
            "--registry-interval-s", "0.3", "--health-interval-s", "0.5",
        ],
        tmp_path / "router.log",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, router)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:

            async def both_known() -> bool:
                return len((await client.get("/replicas")).json()["replicas"]) == 2

            await wait_until(both_known, within=15)
            home, predicted, cached = await _complete(client, _prompt("a"))
            assert (predicted, cached) == (0, 0)

            async def where(prompt: str) -> dict[str, Any]:
                body = {"model": "sim", "prompt": prompt}
                answer: dict[str, Any] = (await client.post("/index", json=body)).json()
                return answer

            async def placed(tier: str) -> bool:
                held = (await where(_prompt("a")))["replicas"].get(home)
                return held is not None and held["tier"] == tier

            await wait_until(lambda: placed("gpu"))
            # two other prompts sent straight to that engine push the first out of its GPU
            # cache (64 blocks) into its CPU tier
            replicas = (await client.get("/replicas")).json()["replicas"]
            engine_url = next(r["url"] for r in replicas if r["id"] == home)
            async with httpx.AsyncClient(base_url=engine_url, timeout=10) as engine:
                for seed in "bc":
                    body = {"model": "sim", "prompt": _prompt(seed), "max_tokens": 2}
                    assert (await engine.post("/v1/completions", json=body)).status_code == 200
            await wait_until(lambda: placed("cpu"))
            shown = (await where(_prompt("a")))["replicas"][home]
            assert shown["cpu_blocks"] == shown["matched_blocks"] == 600 // BLOCK
            assert shown["gpu_blocks"] == shown["storage_blocks"] == shown["remote_blocks"] == 0
            score = next(
                s for s in (await where(_prompt("a")))["decision"]["scores"] if s["replica"] == home
            )
            assert score["offload_cached_tokens"] == 37 * BLOCK
            assert score["loading_tokens"] == pytest.approx(0.3 * 37 * BLOCK)

            # the router sends the prompt home (loading beats recomputing elsewhere), and the
            # engine loads it: its cached tokens are the router's prediction
            again = await _complete(client, _prompt("a"))
            assert again == (home, 37 * BLOCK, 37 * BLOCK)
            await wait_until(lambda: placed("gpu"))  # loaded back into the GPU cache
    finally:
        for proc in (router, tracker, replica):
            proc.close()
