"""The real peer routers as benchmark arms, end to end (only where they are installed).

``pip install -e '.[peers]'`` installs vllm-router 0.1.17 and sglang-router 0.3.2, and
``scripts/install-smg`` smg 1.13 into ``.peers/smg13``; without them each arm is skipped with
the reason. Every arm runs as its own process on the router's
port in front of the same simulated engines, and must serve the whole workload with the
prefixes reused (vllm-router's kv_aware from the engines' own KV events and replay).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.fleet import FleetConfig
from bench.harness import Harness
from bench.peers import (
    INSTALL_HINT,
    PEERS,
    ROOT,
    PeerArm,
    Worker,
    executable,
    install_hint,
    missing,
)
from bench.summary import summarize
from bench.workloads import Workload, shared_prefix, with_poisson_arrivals

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


def tiny_workload(*, prompts_per_group: int, seed: int) -> Workload:
    """Two groups of a 600-token prefix, 8-token answers, 4 requests/s."""
    workload = shared_prefix(
        groups=2,
        prompts_per_group=prompts_per_group,
        system_tokens=600,
        question_tokens=32,
        output_tokens=8,
        seed=seed,
    )
    return with_poisson_arrivals(workload, rate=4.0, seed=seed)


@pytest.mark.parametrize("arm", sorted(PEERS))
def test_peer_arm_serves_the_workload_in_front_of_the_same_engines(
    arm: str, tmp_path: Path
) -> None:
    absent = missing([arm])
    if absent:
        pytest.skip(f"{arm}: {absent[arm]} is not installed ({install_hint(arm)})")
    workload = tiny_workload(prompts_per_group=4, seed=3)
    fleet = FleetConfig(replicas=2, time_scale=1.0, num_blocks=512, workdir=tmp_path)
    [run] = Harness(fleet, workload, (arm,)).run()
    summary = summarize(run, fleet.time_scale)
    assert summary.errors == 0, [r.error for r in run.results if r.error]
    assert summary.requests == 8
    assert sum(summary.per_replica.values()) == 8  # from the engines' own counters
    assert summary.hit_rate > 0.3  # each group's prefix was reused after its first request
    assert (tmp_path / "peer-0.log").exists()


def test_a_peer_arm_follows_kvrouter_in_embedded_mode(tmp_path: Path) -> None:
    """Without Redis the index lives in the router, which a peer replaces on its port: the
    fleet still settles (on the engines' probes) and both arms serve."""
    arm = next((a for a in sorted(PEERS) if not missing([a])), None)
    if arm is None:
        pytest.skip(f"no peer router is installed ({INSTALL_HINT})")
    workload = tiny_workload(prompts_per_group=3, seed=4)
    fleet = FleetConfig(replicas=2, time_scale=1.0, num_blocks=512, redis=False, workdir=tmp_path)
    runs = Harness(fleet, workload, ("kvrouter", arm)).run()
    assert [run.policy for run in runs] == ["kvrouter", arm]
    for run in runs:
        summary = summarize(run, fleet.time_scale)
        assert summary.errors == 0, [r.error for r in run.results if r.error]
        assert summary.requests == 6


def test_smg13_runs_at_its_own_defaults_from_its_own_virtualenv() -> None:
    """smg 1.13 is looked for in ``.peers/smg13`` only (never sglang-router's ``bin/smg``),
    and started with only the flags that put it on its ports and make it ready: nothing
    that changes how it routes (scrape interval, overload protection, warm-up, thresholds)."""
    arm = PEERS["smg13"]
    assert isinstance(arm, PeerArm)
    assert executable(arm.binary) in (None, str(ROOT / ".peers" / "smg13" / "bin" / "smg"))
    assert executable(".peers/absent/bin/smg") is None
    workers = [Worker("http://127.0.0.1:1", "tcp://127.0.0.1:2", None)]
    argv = arm.argv("smg", port=3, metrics_port=4, workers=workers, block_size=16, model="m")
    flags = {a for a in argv if a.startswith("--")}
    assert flags == {
        "--host",
        "--port",
        "--worker-urls",
        "--policy",
        "--prometheus-port",
        "--prometheus-host",
        "--worker-startup-check-interval",
        "--log-level",
    }
    assert argv[argv.index("--policy") + 1] == "cache_aware"
