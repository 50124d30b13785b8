"""The real ``kvrouter lookup`` console script against a Redis index filled through RedisIndex."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.factories import LLAMA, batch, removed, stored
from tests.procs import KVROUTER, free_port, kvrouter_env
from tracker.core.blocks import block_keys
from tracker.core.redis_index import RedisIndex

TOKENS = list(range(500, 516))  # 4 blocks of 4
HASHES = [11, 12, 13, 14]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVROUTER), "lookup", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=kvrouter_env(env),
        check=False,
    )


def placement(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out: dict[str, Any] = json.loads(result.stdout)
    return out


@pytest.fixture
async def filled(redis_url: str) -> str:
    """r1 holds all 4 blocks on GPU, r2 the first 2 (block 1 only offloaded), r3 a LoRA copy."""
    index = RedisIndex.from_url(redis_url)
    try:
        await index.apply("r1", LLAMA, batch(stored(TOKENS, HASHES)), 1)
        first_two = stored(TOKENS[:8], HASHES[:2])
        cpu = stored([], [12], block_size=0, medium="CPU")
        await index.apply("r2", LLAMA, batch(first_two, cpu, removed(12)), 1)
        lora = stored(TOKENS[:4], [21], lora_name="a")
        await index.apply("r3", LLAMA, batch(lora), 1)
        found = await index.lookup(LLAMA, block_keys(TOKENS, LLAMA))
        assert set(found) == {"r1", "r2"}
    finally:
        await index.close()
    return redis_url


def expected(**replicas: tuple[int, int]) -> dict[str, Any]:
    return {
        r: {
            "matched_blocks": blocks,
            "matched_tokens": blocks * LLAMA.block_size,
            "gpu_blocks": gpu,
            "cpu_blocks": blocks - gpu,
            "storage_blocks": 0,
            "remote_blocks": 0,
            "offload_blocks": blocks - gpu,
            "tier": "gpu" if gpu == blocks else "cpu" if gpu == 0 else "mixed",
        }
        for r, (blocks, gpu) in replicas.items()
    }


COMMON = ("--model", "llama", "--block-size", "4")


def test_lookup_prints_placement(filled: str) -> None:
    out = placement(run("--redis", filled, *COMMON, "--tokens", ",".join(map(str, TOKENS))))
    assert out == {
        "model": "llama",
        "block_size": 4,
        "tokens": 16,
        "blocks": 4,
        "replicas": expected(r1=(4, 4), r2=(2, 1)),
    }
    assert list(out["replicas"]) == ["r1", "r2"]  # longest match first


def test_lookup_with_lora_partial_block_and_env(filled: str) -> None:
    tokens = ",".join(map(str, TOKENS[:6]))
    env = {"KVROUTER_LOOKUP_REDIS": filled, "KVROUTER_LOOKUP_MODEL": "mistral"}
    out = placement(
        run("--model", "llama", "--block-size", "4", "--lora", "a", "--tokens", tokens, env=env)
    )
    assert (out["tokens"], out["blocks"]) == (6, 1)
    assert out["replicas"] == expected(r3=(1, 1))
    other_model = placement(run("--block-size", "4", "--tokens", tokens, env=env))
    assert other_model["model"] == "mistral"
    assert other_model["replicas"] == {}


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(json.dumps(TOKENS), id="json-array"),
        pytest.param(",".join(map(str, TOKENS)), id="comma"),
        pytest.param(
            "\n".join(" ".join(map(str, TOKENS[i : i + 4])) for i in range(0, 16, 4)) + "\n",
            id="whitespace",
        ),
    ],
)
def test_lookup_tokens_file(filled: str, tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text(content)
    out = placement(run("--redis", filled, *COMMON, "--tokens-file", str(path)))
    assert out["replicas"] == expected(r1=(4, 4), r2=(2, 1))


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("--tokens", "1,x,3"), id="not-an-int"),
        pytest.param(("--tokens=-1,2",), id="negative"),
        pytest.param(("--tokens", str(1 << 32)), id="too-big"),
        pytest.param(("--tokens", "[1, 2"), id="bad-json"),
        pytest.param(("--tokens", '["a"]'), id="json-string"),
        pytest.param(("--tokens-file", "/nonexistent/tokens.json"), id="missing-file"),
        pytest.param(("--tokens", "1", "--tokens-file", "/dev/null"), id="both"),
        pytest.param((), id="neither"),
    ],
)
def test_bad_tokens_exit_with_a_message(redis_url: str, args: tuple[str, ...]) -> None:
    result = run("--redis", redis_url, *COMMON, *args)
    assert result.returncode == 2
    assert "kvrouter lookup" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_unreachable_redis_exits_1() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run("--redis", url, *COMMON, "--tokens", ",".join(map(str, TOKENS)))
    assert result.returncode == 1
    assert "kvrouter lookup:" in result.stderr
    assert "redis" in result.stderr.lower()
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_bad_redis_url_exits_2() -> None:
    result = run("--redis", "http://127.0.0.1:1", *COMMON, "--tokens", ",".join(map(str, TOKENS)))
    assert result.returncode == 2
    assert "Redis URL" in result.stderr
    assert "Traceback" not in result.stderr
