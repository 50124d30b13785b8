"""Commands that plot check for matplotlib (the ``bench`` extra) before they start anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KVROUTER = Path(sys.executable).parent / "kvrouter"
HINT = "pip install -e '.[bench]'"


def without_matplotlib(tmp_path: Path) -> dict[str, str]:
    """The environment, with a ``matplotlib`` first on the path that fails to import."""
    shadow = tmp_path / "shadow"
    (shadow / "matplotlib").mkdir(parents=True)
    (shadow / "matplotlib" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'matplotlib'\")\n"
    )
    path = [str(shadow), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["bench", "--quick", "--policies", "round-robin", "--plot", "{tmp}/ttft.png"], "--plot"),
        (["matrix", "--report", "--out", "{tmp}/results", "--plots", "{tmp}/img"], "--plots"),
    ],
    ids=["bench", "matrix"],
)
def test_a_plotting_command_without_matplotlib_fails_before_it_runs(
    tmp_path: Path, argv: list[str], option: str
) -> None:
    result = subprocess.run(
        [str(KVROUTER), *(arg.format(tmp=tmp_path) for arg in argv)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=without_matplotlib(tmp_path),
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""  # no plan, no progress, no report: nothing ran
    assert result.stderr.splitlines() == [
        f"kvrouter {argv[0]}: {option} needs matplotlib (No module named 'matplotlib'): {HINT}"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shadow"]
