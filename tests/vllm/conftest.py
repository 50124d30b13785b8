"""The real-vLLM tier: opt in with ``KVROUTER_VLLM=1`` (``scripts/test-vllm`` sets it, after
``scripts/vllm-install`` made ``.venv-vllm`` and the tiny model). Skipped otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM = Path(os.environ.get("KVROUTER_VLLM_BIN", ROOT / ".venv-vllm" / "bin" / "vllm"))
MODEL = Path(os.environ.get("KVROUTER_VLLM_MODEL", ROOT / ".cache" / "tiny-qwen2"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KVROUTER_VLLM") == "1":
        missing = [str(p) for p in (VLLM, MODEL / "config.json") if not p.exists()]
        if missing:
            raise pytest.UsageError(f"KVROUTER_VLLM=1 but {missing} missing: scripts/vllm-install")
        return
    skip = pytest.mark.skip(reason="the real-vLLM tier: KVROUTER_VLLM=1 (scripts/test-vllm)")
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(skip)
