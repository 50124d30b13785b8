"""Project-level rules: import direction between the parts, and docs generated from code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "tracker": {"router", "publishers", "bench"},
    "router": {"publishers", "bench"},
    "publishers": {"router", "bench"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_go_one_way(part: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[part])
        for path in (ROOT / part).rglob("*.py")
        if imported_packages(path) & FORBIDDEN[part]
    }
    assert offenders == {}


def test_readme_settings_tables_are_generated_from_the_settings_classes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.settings_doc", "--check", str(ROOT / "README.md")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
