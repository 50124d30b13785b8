"""``kvrouter demo --vllm``: the demo's two policies on two real vLLM engines (a module of
its own: the other module's engines are stopped before these start)."""

from __future__ import annotations

import re

import pytest

from bench.stack.demo import DemoSettings
from bench.stack.demo import run as demo
from tests.vllm.conftest import MODEL, VLLM

pytestmark = pytest.mark.timeout(900)


def test_demo_compares_round_robin_and_kvrouter_on_real_vllm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = DemoSettings(
        vllm=str(VLLM),
        vllm_model=str(MODEL),
        groups=4,
        per_group=6,
        prefix_tokens=2400,  # characters of text: ~2,000 of the tiny BPE's tokens (62 blocks)
        output_tokens=8,
        num_blocks=160,  # two prefixes per engine: kvrouter keeps 2 groups on each, round-robin 4
        rate=4.0,  # the capacity estimate is an H200's: set the CPU engines' rate instead
    )
    assert demo(settings) == 0
    out = capsys.readouterr().out
    assert "latencies in ms" in out
    served = re.search(r"served\s+(\d+)%\s+of\s+prompt\s+tokens.*?instead\s+of\s+(\d+)%", out, re.S)
    assert served is not None, out
    kvrouter, round_robin = (int(x) for x in served.groups())
    assert kvrouter > round_robin, out
