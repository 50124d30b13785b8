"""The one-request-at-a-time overhead benchmark end to end on a few rounds: kvrouter with
Redis and embedded (its own index, one process) against the engines, real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.overhead import EMBEDDED, main

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


def test_every_router_arm_is_measured_against_the_engines(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    assert main(["--rounds", "6", "--groups", "2", "--peers", "", "--json", str(out)]) == 0
    targets = json.loads(out.read_text())["targets"]
    assert set(targets) == {"direct", "kvrouter", EMBEDDED}
    for name in ("kvrouter", EMBEDDED):
        row = targets[name]
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"]
        assert "added_p50_ms" in row  # paired with the direct request of each round
        assert row["cpu_ms_per_request"] > 0  # read from the router's process tree
