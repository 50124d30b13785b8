"""Lookahead hashing (vLLM 0.33 with EAGLE-style drafting): each block's hash covers the
tokens after it, so a block hits only for a prompt that goes on the same way. Simulated
engines that hash so and a router started with the same ``--lookahead-tokens`` must agree on
every request's cached tokens, including at the block where two prompts part."""

from __future__ import annotations

import httpx
import pytest

from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.router.harness import base_url, engines, router, wait_until

pytestmark = pytest.mark.timeout(60)
LOOKAHEAD = 3
BLOCK = 16


async def _complete(client: httpx.AsyncClient, prompt: str) -> tuple[int, int, str]:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 2}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(response.headers[PREDICTED_HEADER]), cached, response.headers[REPLICA_HEADER]


@pytest.mark.parametrize("configured", [LOOKAHEAD, None], ids=["set", "learned"])
async def test_predictions_follow_lookahead_hashing(configured: int | None) -> None:
    """``--lookahead-tokens`` set, or left to what the tracker saw in the engine's events
    (the router learns it from its first lookup)."""
    shared = "".join(chr(ord("a") + i % 26) for i in range(20 * BLOCK))
    async with (
        engines(1, lookahead_tokens=LOOKAHEAD, time_scale=0.01) as fleet,
        router(replica=fleet.specs, lookahead_tokens=configured, predict_ttl_s=0) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=30) as client,
    ):
        first = await _complete(client, shared + "X" * 40)
        assert first[:2] == (0, 0)

        async def indexed() -> bool:  # the first prompt's events reached the index
            body = {"model": "sim", "prompt": shared + "X" * 40}
            where = (await client.post("/index", json=body)).json()["replicas"]
            return any(r["matched_tokens"] >= len(shared) for r in where.values())

        await wait_until(indexed)
        rows = []
        # prompts that part from the first one at every offset of the last shared block
        for cut in range(1, BLOCK + 1):
            prompt = shared[: len(shared) - cut] + "Y" * (40 + cut)
            rows.append((cut, *await _complete(client, prompt)))
    assert all(predicted == cached for _, predicted, cached, _ in rows), rows
    by_cut = {cut: cached for cut, _, cached, _ in rows}
    # a block counts only if the LOOKAHEAD tokens after it are the first prompt's too: where
    # the prompts part fewer than LOOKAHEAD tokens after a block's end, that block misses
    # (hashed without lookahead, the last shared block would hit at every cut)
    shared_tokens = len(shared)  # the builtin tokenizer: one token per character, no BOS
    expected = {cut: (shared_tokens - cut - LOOKAHEAD) // BLOCK * BLOCK for cut in by_cut}
    assert by_cut == expected
    assert len(set(expected.values())) == 2
