"""``--decision-log``: every routing decision as one JSON line, with its inputs and scores."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.router.harness import SYSTEM, base_url, chat, engines, router

pytestmark = pytest.mark.timeout(30)


async def test_every_decision_is_journaled_with_its_breakdown(tmp_path: Path) -> None:
    log = tmp_path / "decisions.jsonl"
    async with (
        engines(2) as fleet,
        router(replica=fleet.specs, decision_log=str(log)) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        for i in range(3):
            response = await client.post("/v1/chat/completions", json=chat(SYSTEM, f"q{i}"))
            assert response.status_code == 200
        # an operator's dry run (/index) is not a decision
        assert (await client.post("/index", json=chat(SYSTEM, "q"))).status_code == 200
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 3
    first = lines[0]
    assert set(first["candidates"]) == {"replica-0", "replica-1"}
    assert first["chosen"] in first["candidates"] and first["fallback"] is None
    assert first["prompt_tokens"] > 16 * first["blocks"] - 16 >= 0
    assert len({line["first_key"] for line in lines}) == 1  # one shared prefix
    # the real time of each stage, which add up to the total
    stages = first["stages_ms"]
    assert set(stages) == {"tokenize", "hash", "lookup", "score", "total"}
    parts_ms = sum(stages[s] for s in ("tokenize", "hash", "lookup", "score"))
    assert 0 < stages["total"] == pytest.approx(parts_ms, abs=0.01)
    chosen = first["candidates"][first["chosen"]]
    for field in ("matched", "predicted", "queue_ms", "ttft_ms", "score", "regret", "home"):
        assert field in chosen
    # the score is its parts: -(ttft + compute + evict), each logged
    parts = chosen["ttft_ms"] + chosen["compute_ms"] + chosen["evict_ms"]
    assert chosen["score"] == pytest.approx(-parts, abs=0.01)
    assert chosen["cache_blocks"] in (None, 2048)
