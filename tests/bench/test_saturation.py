"""The saturation benchmark end to end on a tiny plan: the engines direct and two kvrouter
arms (one process, ``--workers 2``), real processes, every row filled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.saturation import main, render

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


def test_a_tiny_run_measures_every_target_at_every_level(tmp_path: Path) -> None:
    out = tmp_path / "saturation.json"
    argv = ["--concurrency", "1,4", "--seconds", "0.5", "--workers", "1,2", "--peers", ""]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    targets = report["targets"]
    assert set(targets) == {"direct", "kvrouter-w1", "kvrouter-w2"}
    for name, levels in targets.items():
        assert set(levels) == {"1", "4"}
        for row in levels.values():
            assert row["errors"] == 0 and row["requests"] > 0, (name, row)
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
            assert row["gap_p99_ms"] > 0  # 16-token streams: chunks apart
            if name != "direct":
                assert row["cpu_ms_per_request"] > 0  # read from the router's process tree
                assert "added_p50_ms" in row
    assert report["saturation"]["kvrouter-w2"] > 0
    assert "kvrouter-w2" in render(targets)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--concurrency", "0"])
    with pytest.raises(SystemExit):
        main(["--peers", "nginx"])
