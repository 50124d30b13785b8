"""The dynamo arm (:mod:`bench.dynamo`): its model directory, its skip, and end to end (only
where ``scripts/install-dynamo`` installed Dynamo) the engines' own tokens and prefix hits
through Dynamo's frontend, adapters and KV router."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from bench.dynamo.arm import DYNAMO, VENV_ENV, dynamo_python
from bench.dynamo.hop import HopSettings
from bench.dynamo.model import write_model_dir
from bench.fleet import FleetConfig
from bench.harness import Harness
from bench.peers import installed, missing
from bench.stack.config import StackConfig
from bench.stack.local import LocalStack
from bench.stack.ports import free_ports
from bench.summary import summarize
from bench.workloads import shared_prefix, with_poisson_arrivals
from tracker.core.tokens import Tokenizer
from tracker.framework.cli import parse_argv

needs_dynamo = pytest.mark.skipif(
    dynamo_python() is None, reason=f"{DYNAMO.package} is not installed ({DYNAMO.install})"
)
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis")
SYSTEM = "You review pull requests for a storage engine. " * 12  # ~560 tokens: 35 blocks
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is it safe?"}]


def test_the_model_directory_tokenizes_chats_as_the_engines_do(tmp_path: Path) -> None:
    """Dynamo encodes the rendered template with the exported tokenizer.json through the
    HuggingFace pipeline: that pipeline must give the engines' ids (their fast path)."""
    model = write_model_dir(tmp_path, context_length=8192)
    engine = Tokenizer.builtin()
    exported = HFTokenizer.from_file(str(model / "tokenizer.json"))
    text = engine.render_chat([*MESSAGES, {"role": "user", "content": "naïve — ünïcode ✓"}])
    assert exported.encode(text, add_special_tokens=False).ids == engine.encode(text)
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and "<|im_start|>" in config["chat_template"]
    generation = json.loads((model / "generation_config.json").read_text())
    assert generation["eos_token_id"] == engine.eos_token_id


def test_without_its_virtualenv_the_arm_is_skipped_with_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(VENV_ENV, str(tmp_path / "nowhere"))
    assert dynamo_python() is None
    assert missing(["dynamo", "kvrouter"]) == {"dynamo": DYNAMO.package}
    assert installed("dynamo") == []
    err = capsys.readouterr().err
    assert "dynamo: skipped, ai-dynamo==1.6.1 is not installed (scripts/install-dynamo)" in err


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[LocalStack, str]]:
    """Two fast engines (no Redis) and the dynamo arm's one frontend in front of them."""
    config = StackConfig(replicas=2, routers=1, redis=False, time_scale=0.01, workdir=tmp_path)
    with LocalStack(config).start() as stack:
        port = free_ports(1)
        DYNAMO.start(stack, [("dynamo", port)])
        yield stack, f"http://127.0.0.1:{port}"


def chat(url: str, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any]]:
    """A streamed chat's text and usage."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage = "", dict[str, Any]()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30.0) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            for choice in event.get("choices") or ():
                text += choice["delta"].get("content") or ""
            usage = event.get("usage") or usage
    return text, usage


@needs_dynamo
@pytest.mark.timeout(120)
def test_dynamo_sends_the_engines_own_tokens_and_finds_their_blocks(
    fleet: tuple[LocalStack, str],
) -> None:
    stack, dynamo = fleet
    block = stack.config.block_size
    for i in range(4):  # each prompt cached on one engine, then sent through Dynamo
        messages = [{"role": "system", "content": f"{i}: {SYSTEM}"}, MESSAGES[1]]
        direct_text, direct = chat(stack.layout.replica_urls[(i + 1) % 2], messages)
        text, usage = chat(dynamo, messages)
        # the engine's output is seeded by the prompt's ids: Dynamo sent the engine's own
        assert text == direct_text and len(text) > 0
        assert usage["prompt_tokens"] == direct["prompt_tokens"]
        assert usage["completion_tokens"] == direct["completion_tokens"]
        # and found, by its own hashes of its own tokens, the engine that holds the blocks
        # (the other one, with as little load, would have computed them: 1 in 16 by chance)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == direct["prompt_tokens"] // block * block, i
    # a new question on a known system prompt goes where the prefix is
    follow = [{"role": "system", "content": f"0: {SYSTEM}"}, {"role": "user", "content": "Fast?"}]
    _, again = chat(dynamo, follow)
    assert again["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM) // block * block


@needs_dynamo
@needs_redis
@pytest.mark.timeout(240)
def test_the_arm_with_two_frontends_in_sync_reuses_prefixes(tmp_path: Path) -> None:
    """The routers axis: two frontends (``--router-replica-sync``) behind haproxy."""
    workload = shared_prefix(
        groups=2,
        prompts_per_group=6,
        system_tokens=600,
        question_tokens=32,
        output_tokens=8,
        seed=5,
    )
    workload = with_poisson_arrivals(workload, rate=6.0, seed=5)
    fleet = FleetConfig(replicas=2, routers=2, num_blocks=512, time_scale=0.2, workdir=tmp_path)
    [run] = Harness(fleet, workload, ("dynamo",)).run()
    summary = summarize(run, fleet.time_scale)
    assert summary.errors == 0, [r.error for r in run.results if r.error]
    assert summary.requests == 12
    assert sum(run.engine_requests.values()) == 12  # the engines' own counters
    assert summary.hit_rate > 0.5  # each prefix computed about once, then reused
    for name in ("peer-0", "peer-1", "dynamo-adapter-0", "dynamo-adapter-1"):
        assert (tmp_path / f"{name}.log").exists()


def test_the_hop_measurement_takes_its_flags_from_its_settings() -> None:
    settings = parse_argv(HopSettings, ["--rounds", "50", "--json", "x.json"])
    assert (settings.rounds, settings.time_scale, settings.json) == (50, 0.001, "x.json")
