"""Shared by the codec tests: the golden vLLM payloads (tests/data/vectors), wire constants."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from tests.conftest import VECTORS

U64 = (1 << 64) - 1
TS = 1700000000.5
pack = msgspec.msgpack.encode

GOLDEN_FILES = sorted(VECTORS.glob("vllm-v*.jsonl"))


def _golden() -> list[Any]:
    params = []
    for path in GOLDEN_FILES:
        for line in path.read_text().splitlines():
            if line.strip():
                vector = json.loads(line)
                params.append(pytest.param(vector, id=f"{path.stem}/{vector['name']}"))
    return params


GOLDEN = _golden()
