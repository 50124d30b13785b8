"""The one-request-at-a-time overhead benchmark end to end on a few rounds: kvrouter with
Redis and embedded (its own index, one process) against the engines, then Envoy with and
without kvrouter epp, real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gateway import ENVOY, EPP
from bench.overhead import EMBEDDED, main
from bench.stack.envoy import MISSING, envoy_binary

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


def test_every_router_arm_is_measured_against_the_engines(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    argv = ["--rounds", "6", "--groups", "2", "--peers", "", "--epp", "", "--no-envoy"]
    assert main([*argv, "--json", str(out)]) == 0
    targets = json.loads(out.read_text())["targets"]
    assert set(targets) == {"direct", "kvrouter", EMBEDDED}
    for name in ("kvrouter", EMBEDDED):
        row = targets[name]
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"]
        assert "added_p50_ms" in row  # paired with the direct request of each round
        assert row["cpu_ms_per_request"] > 0  # read from the router's process tree


@pytest.mark.skipif(envoy_binary() is None, reason=MISSING)
def test_the_pickers_own_time_is_paired_with_envoy_alone(tmp_path: Path) -> None:
    """Envoy + kvrouter epp against Envoy alone (the client naming the engine) at long
    prompts: the paired difference, the picker's decision time and the CPU of each part."""
    out = tmp_path / "overhead.json"
    argv = ["--rounds", "6", "--groups", "2", "--peers", "", "--no-embedded"]
    argv += ["--no-epp-headers", "--prompt-tokens", "8000", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    targets = report["targets"]
    assert report["prompt_tokens"] == 8000
    assert set(targets) == {"direct", "kvrouter", EPP, ENVOY}
    row = targets[EPP]
    assert {"added_over_envoy_p50_ms", "added_over_envoy_p99_ms"} <= set(row)
    assert 0 < row["decision_p50_ms"] <= row["decision_p99_ms"]  # x-kvrouter-decision-ms
    assert row["cpu_epp_ms_per_request"] > 0 and row["cpu_envoy_ms_per_request"] > 0
    assert (
        "decision_p50_ms" not in targets[ENVOY] and targets[ENVOY]["cpu_envoy_ms_per_request"] > 0
    )
