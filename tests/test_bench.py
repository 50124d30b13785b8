"""``kvrouter bench --quick`` and ``kvrouter demo --embedded`` end to end on local fleets."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.commands import QUICK, BenchSettings, plan, run
from bench.fleet import FleetConfig
from bench.matrix.cells import Cell, cells
from bench.matrix.commands import MatrixSettings, run_cell
from bench.matrix.report import full_tables
from bench.matrix.verdicts import verdict
from bench.stack.config import VllmEngines
from bench.stack.demo import DemoSettings
from bench.stack.demo import run as demo
from bench.stack.envoy import MISSING, envoy_binary
from tracker.framework.errors import ConfigError

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


def test_quick_bench_compares_round_robin_and_kvrouter(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    plot = tmp_path / "quick.png"
    settings = BenchSettings(
        quick=True, policies="round-robin,kvrouter", json=str(out), plot=str(plot)
    )
    assert run(settings) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["name"] == "gsp" and doc["requests"] == 64
    assert doc["time_scale"] == 2.0 and 0 < doc["load"] <= 1
    assert list(doc["policies"]) == ["round-robin", "kvrouter"]
    for summary in doc["policies"].values():
        assert summary["requests"] == 64 and summary["errors"] == 0
        assert set(summary["ttft_ms"]) == {"p50", "p95", "p99", "mean"}
        assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
        assert summary["e2e_ms"]["p50"] > 0 and summary["output_tokens_per_s"] > 0
        assert sum(summary["per_replica"].values()) == 64
        assert summary["decision_ms"]["p50"] >= 0
        assert 0 <= summary["hit_rate"] <= 1
    rr, kv = doc["policies"]["round-robin"], doc["policies"]["kvrouter"]
    assert kv["hit_rate"] > rr["hit_rate"]
    assert kv["vs_round_robin"]["ttft_p50"] > 0
    assert plot.stat().st_size > 0 and (tmp_path / "quick-bars.png").stat().st_size > 0


@pytest.mark.skipif(envoy_binary() is None, reason=MISSING)
def test_bench_gateway_runs_the_routers_as_endpoint_pickers_behind_envoy(tmp_path: Path) -> None:
    """``kvrouter bench --gateway``: the in-router arms restarted per policy as ``epp-*``
    processes behind Envoy; the peers, proxies, skipped; the answers carry the pickers'
    receipts (engine, decision time) as the proxy's do."""
    out = tmp_path / "gateway.json"
    tiny = {"quick": True, "replicas": 2, "groups": 2, "prompts_per_group": 4, "time_scale": 1.0}
    settings = BenchSettings(
        **tiny, routers=2, gateway=True, policies="round-robin,kvrouter,smg", json=str(out)
    )
    assert run(settings) == 0
    doc = json.loads(out.read_text())
    assert doc["fleet"]["gateway"] is not None and doc["fleet"]["routers"] == 2
    assert list(doc["policies"]) == ["round-robin", "kvrouter"]
    for summary in doc["policies"].values():
        assert summary["requests"] == 8 and summary["errors"] == 0
        assert sum(summary["per_replica"].values()) == 8
    rr, kv = doc["policies"]["round-robin"], doc["policies"]["kvrouter"]
    assert kv["hit_rate"] >= rr["hit_rate"]
    # the pickers were restarted with each --policy: round robin tokenizes nothing
    assert kv["decision_ms"]["p50"] > rr["decision_ms"]["p50"]
    # kvrouter matrix --gateway: the same cells, in result files of their own
    behind = MatrixSettings(axes="routers", gateway=True).cells()[0]
    proxied = cells(("routers",))[0]
    assert behind.settings == {**proxied.settings, "gateway": True}
    assert behind.key != proxied.key


def test_a_matrix_cell_of_two_seeds_pools_both_passes(tmp_path: Path) -> None:
    tiny = {"quick": True, "replicas": 2, "groups": 2, "prompts_per_group": 4, "time_scale": 1.0}
    cell = Cell("cache", "tiny", tiny, seeds=2)
    settings = MatrixSettings(policies="round-robin,kvrouter", out=str(tmp_path))
    path = tmp_path / f"{cell.key}.json"
    doc = run_cell(cell, settings, path)
    assert json.loads(path.read_text()) == doc
    assert doc["seeds"] == [1, 2] and [p["seed"] for p in doc["passes"]] == [1, 2]
    for name in ("round-robin", "kvrouter"):
        pooled = doc["policies"][name]
        assert pooled["requests"] == 16 and pooled["errors"] == 0  # 8 per pass
        assert sum(pooled["per_replica"].values()) == 16
        hits = [p["policies"][name]["hit_rate"] for p in doc["passes"]]
        assert min(hits) <= pooled["hit_rate"] <= max(hits)
    # one pass after the other, each pass's groups apart from the other's: 4 groups in all
    raw = json.loads(path.with_suffix(".raw.json").read_text())
    rows = [dict(zip(raw["fields"], r, strict=True)) for r in raw["results"]["kvrouter"]]
    assert len(rows) == 16 and {r["group"] for r in rows} == {0, 1, 2, 3}
    assert max(r["sent_s"] for r in rows[:8]) < min(r["sent_s"] for r in rows[8:])
    assert "x 2 seeds (1, 2; pooled)" in full_tables([verdict(cell, doc)])


def test_real_vllm_engines_are_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="scripts/vllm-install installs it"):
        BenchSettings(vllm=str(tmp_path / "vllm"))
    binary = tmp_path / "vllm"
    binary.touch()
    with pytest.raises(ConfigError, match="no model in"):
        BenchSettings(vllm=str(binary), vllm_model=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not with restart"):
        BenchSettings(vllm=str(binary), vllm_model=str(tmp_path), restart_engine_at_s=5)


def test_demo_runs_embedded_with_one_router() -> None:
    settings = DemoSettings(embedded=True, replicas=2, groups=4, per_group=4)
    assert demo(settings) == 0


def _alive(pid: int) -> bool:
    """Running (a zombie left to an init that does not reap counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_sigterm_stops_the_fleet_instead_of_orphaning_it() -> None:
    kvrouter = Path(sys.executable).parent / "kvrouter"
    with subprocess.Popen(
        [str(kvrouter), "bench", "--quick", "--policies", "round-robin"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # the fleet is up once a policy starts
                if "restarting the router" in line:
                    break
            listing = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
            children = [int(pid) for pid in listing.split()]
            assert len(children) >= 3, children  # redis-server, the engines, the tracker, ...
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
            assert proc.returncode != 0
        finally:
            if proc.poll() is None:
                proc.kill()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def test_a_real_vllm_plan_describes_its_engines_in_json(tmp_path: Path) -> None:
    """The JSON ``kvrouter bench --vllm --json`` writes names the vLLM binary and model (a
    Path in the fleet description made it raise after the whole run)."""
    chosen = plan(BenchSettings(quick=True))
    engines = VllmEngines(tmp_path / "bin" / "vllm", tmp_path / "tiny", num_gpu_blocks=160)
    real = dataclasses.replace(chosen, fleet=dataclasses.replace(chosen.fleet, vllm=engines))
    meta = json.loads(json.dumps(real.meta()))
    assert meta["vllm"] == {
        "binary": str(tmp_path / "bin" / "vllm"),
        "model": str(tmp_path / "tiny"),
    }
    assert "vllm" not in meta["fleet"] and json.loads(json.dumps(chosen.meta()))["vllm"] is None


@pytest.mark.parametrize("quick", [False, True])
def test_a_fleet_left_unset_is_the_one_the_help_describes(quick: bool) -> None:
    fleet = plan(BenchSettings(workload="nosharing", requests=8, quick=quick)).fleet
    expected = QUICK if quick else FleetConfig()
    assert (fleet.replicas, fleet.num_blocks, fleet.time_scale) == (
        expected.replicas, expected.num_blocks, expected.time_scale
    )  # fmt: skip
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(BenchSettings)}
    said, end = ("quick", ")") if quick else ("default", ";")  # "(default 8; quick 4)"
    assert f"{said} {fleet.time_scale:g}{end}" in helps["time_scale"]
    assert f"{said} {fleet.replicas}{end}" in helps["replicas"]
    assert f"{said} {fleet.num_blocks}{end}" in helps["num_blocks"]


def test_pinned_vllm_engines_each_get_a_core_of_their_own(tmp_path: Path) -> None:
    engines = VllmEngines(tmp_path / "vllm", tmp_path / "tiny", pin=True)
    cores = os.cpu_count() or 1
    for index in range(3):
        argv = engines.argv("tiny", 32, 8000, 9000, 9100, index=index)
        assert argv[:3] == ["taskset", "-c", str(index % cores)]
        assert argv[3:6] == ["nice", "-n", "5"] and argv[6] == str(tmp_path / "vllm")
    assert VllmEngines(tmp_path / "vllm", tmp_path / "tiny").argv("tiny", 32, 1, 2, 3)[0] == "nice"
