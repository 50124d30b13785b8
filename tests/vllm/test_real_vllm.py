"""kvrouter in front of two real vLLM engines (the CPU build serving a tiny random model).

One stack for the module: redis-server, 2 ``vllm serve`` with KV events on ``tcp://*`` and
replay, the tracker and 2 routers behind haproxy. Engine caches of 160 blocks of 32 tokens
hold one of the ~3,600-token system prompts at a time, so nearly every request evicts.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from bench.stack.config import StackConfig, VllmEngines
from bench.stack.local import LocalStack
from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.vllm.conftest import MODEL, VLLM

pytestmark = pytest.mark.timeout(600)
MODEL_NAME = "tiny"
PROMPTS = 6
SETTLE_S = 0.3


def system_prompt(n: int) -> str:
    rng = random.Random(n)
    words = [
        "".join(rng.choice("bdgklmnprstv") + rng.choice("aeiou") for _ in range(3))
        for _ in range(400)
    ]
    return f"[system {n}] " + " ".join(rng.choice(words) for _ in range(1250))


@contextlib.contextmanager
def vllm_stack(workdir: Path, **overrides: Any) -> Iterator[LocalStack]:
    """A started local stack on real vLLM engines (160-block caches), stopped after."""
    engines = {"num_gpu_blocks": 160, **overrides.pop("engines", {})}
    config = StackConfig(
        model=MODEL_NAME,
        block_size=32,  # the CPU attention backend wants a multiple of 32
        vllm=VllmEngines(VLLM, MODEL, **engines),
        workdir=workdir,
        **overrides,
    )
    stack = LocalStack(config).start(timeout_s=300)  # two vLLM start in ~60 s on 2 cores
    try:
        yield stack
    finally:
        stack.stop()


# two busy-polling CPU engines share 2 cores with Redis: a lookup can overrun the default
# 10 ms budget and be answered by load alone (as in tests/test_topology.py)
LOOKUP_BUDGET = ("--lookup-timeout-ms", "250")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    extra = tuple(os.environ.get("KVROUTER_VLLM_ROUTER_ARGS", "").split())
    workdir = tmp_path_factory.mktemp("vllm-stack")
    # registered by kvrouter's vllm.general_plugins shim, loaded by each vLLM process: the
    # tracker and the routers find the engines in Redis, nobody is given them
    with vllm_stack(
        workdir,
        replicas=2,
        routers=2,
        engines={"attach": True},
        router_args=(*LOOKUP_BUDGET, *extra),
    ) as s:
        yield s


def test_the_attach_shim_registers_each_vllm(stack: LocalStack) -> None:
    for url in stack.layout.router_urls:
        listed = httpx.get(f"{url}/replicas", timeout=5).json()["replicas"]
        assert sorted((r["id"], r["source"]) for r in listed) == [
            ("replica-0", "registry"),
            ("replica-1", "registry"),
        ]
    # nothing else registers them: the stack gives no process a --replica


def chat(n: int, question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [
            {"role": "system", "content": system_prompt(n)},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
        **extra,
    }


def test_openai_sdk_plain_and_streaming(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.layout.entry_url}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hello again"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0


def test_predicted_cached_tokens_equal_vllms_under_eviction(stack: LocalStack) -> None:
    """40 sequential requests over 6 prompts that do not fit: the router's prediction of
    each request's cached tokens against vLLM's ``usage.prompt_tokens_details``."""
    rng = random.Random(7)
    rows = []
    with httpx.Client(base_url=stack.layout.entry_url, timeout=120) as client:
        for i in range(40):
            # steady state: the engines' events of the last request have reached the index
            # (back to back, 1 request in 34 raced them on this 2-core machine: vLLM's
            # publisher thread shares the cores with two busy-polling engines)
            time.sleep(SETTLE_S)
            n = rng.randrange(PROMPTS)
            response = client.post("/v1/chat/completions", json=chat(n, f"q{i}?"))
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            rows.append(
                (
                    int(response.headers[PREDICTED_HEADER]),
                    cached,
                    f"{response.headers[REPLICA_HEADER]}/p{n}",
                )
            )
    steady = rows[PROMPTS:]
    agree = sum(p == c for p, c, _ in steady)
    wrong = [(i, row) for i, row in enumerate(rows) if row[0] != row[1]]
    print(f"\nagreement {agree}/{len(steady)}; disagree (index, row): {wrong}; {rows}")
    assert agree >= 0.99 * len(steady)
    assert sum(c > 0 for _, c, _ in steady) >= len(steady) // 3  # prefixes were reused
    assert len({where.split("/")[0] for *_, where in rows}) == 2  # both engines served


def test_index_shows_where_a_prompt_is_cached(stack: LocalStack) -> None:
    with httpx.Client(base_url=stack.layout.entry_url, timeout=120) as client:
        body = chat(0, "where am I cached?")
        sent = client.post("/v1/chat/completions", json=body)
        assert sent.status_code == 200
        where = client.post("/index", json=body).json()
    holder = sent.headers[REPLICA_HEADER]
    matched = {r: m["matched_tokens"] for r, m in where["replicas"].items() if m["matched_tokens"]}
    assert holder in matched and matched[holder] >= 3000, where


def _tracker_health(stack: LocalStack) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"http://127.0.0.1:{stack.layout.tracker_port}/health").json()
    return body


def _wait(check: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_an_engine_restart_fences_its_blocks(stack: LocalStack) -> None:
    """SIGKILL one vLLM (its engine process too) and start it again: its registry entry
    expires with its heartbeats, the tracker drops what the old process held before the new
    one publishes anything, and indexes the new process's blocks."""
    old, new = chat(3, "before the restart"), chat(4, "after the restart")
    with httpx.Client(base_url=stack.layout.entry_url, timeout=120) as client:
        placed = client.post("/v1/chat/completions", json=old).headers[REPLICA_HEADER]

        def held(body: dict[str, Any]) -> int:
            where = client.post("/index", json=body).json()["replicas"].get(placed, {})
            return int(where.get("matched_tokens", 0))

        _wait(lambda: held(old) >= 3000, 30, "the old process's blocks are indexed")
        index = int(placed.rsplit("-", 1)[1])
        pid = stack.processes.pid(f"vllm-{index}")
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)  # the API server and its engine core child
        stack.processes.kill(f"vllm-{index}")
        stack.processes.restart(f"vllm-{index}", timeout_s=180)
        _wait(lambda: held(old) == 0, 30, "the old process's blocks were fenced")
        # the new process publishes from sequence 0 with its first request
        direct = httpx.post(
            f"{stack.layout.replica_urls[index]}/v1/chat/completions", json=new, timeout=120
        )
        assert direct.status_code == 200
        _wait(lambda: held(new) >= 3000, 30, "the new process's blocks are indexed")
        assert held(old) == 0  # fenced: the old process's cache is gone
    # the dead process stopped heartbeating: its registry entry expired (5 s TTL) before the
    # new one was up (~60 s), and the tracker forgot what it held
    assert f"replica expired replica={placed}" in (stack.workdir / "tracker.log").read_text()
    assert _tracker_health(stack)["replicas"][placed]["synced"]


def test_a_tracker_that_joins_late_rebuilds_the_index_from_vllms_replay(
    stack: LocalStack,
) -> None:
    """A tracker started after the engines published, on an empty Redis (a new index): it
    has no checkpoint, so it asks each vLLM's replay socket for every batch from sequence 0
    and rebuilds what each cache holds now, evictions included."""
    body = chat(5, "cached before the tracker came")
    with httpx.Client(base_url=stack.layout.entry_url, timeout=120) as client:
        sent = client.post("/v1/chat/completions", json=body)
        assert sent.status_code == 200, sent.text
        holder = sent.headers[REPLICA_HEADER]
        stack.processes.kill("tracker")
        with redis.Redis(port=stack.layout.redis_port) as r:
            r.flushall()  # the index, the checkpoints, the registry: all gone

        def ready() -> bool:  # the shims re-register within a heartbeat
            for url in stack.layout.router_urls:
                listed = httpx.get(f"{url}/replicas", timeout=5).json()["replicas"]
                if len(listed) != 2:
                    return False
            return True

        _wait(ready, 30, "the attach shims registered the engines again")
        assert client.post("/index", json=body).json()["replicas"].get(holder, {}).get(
            "matched_tokens", 0
        ) in (0, None)  # nothing indexed: nobody applies events
        log_path = stack.workdir / "tracker.log"
        before = log_path.stat().st_size
        stack.processes.restart("tracker", timeout_s=60)

        def held() -> int:
            where = client.post("/index", json=body).json()["replicas"].get(holder, {})
            return int(where.get("matched_tokens") or 0)

        _wait(lambda: held() >= 3000, 30, "the late tracker indexed what vLLM still holds")
        time.sleep(SETTLE_S)
        again = client.post("/v1/chat/completions", json=chat(5, "and now?"))
        assert again.status_code == 200, again.text
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert again.headers[REPLICA_HEADER] == holder
        assert int(again.headers[PREDICTED_HEADER]) == cached >= 3000

    def both_synced() -> bool:  # the second engine's registry entry may come a moment later
        replicas = _tracker_health(stack)["replicas"]
        return len(replicas) == 2 and all(replica["synced"] for replica in replicas.values())

    _wait(both_synced, 30, "the late tracker tracks both engines, caught up")
    with log_path.open("rb") as f:
        f.seek(before)
        tracked = [line for line in f.read().decode().splitlines() if "replica tracked" in line]
    assert len(tracked) == 2 and all("checkpoint=None" in line for line in tracked), tracked


@pytest.fixture(scope="module")
def silent_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One vLLM whose endpoint names a loopback address: vLLM connects its PUB out."""
    with vllm_stack(
        tmp_path_factory.mktemp("vllm-silent"),
        replicas=1,
        routers=1,
        haproxy=False,
        engines={"events_host": "127.0.0.1"},
        tracker_args=("--silence-check-s", "2"),
        router_args=(*LOOKUP_BUDGET, "--predict-ttl-s", "0"),
    ) as stack:
        yield stack


def test_a_connecting_vllm_endpoint_is_noticed_and_the_index_stays_right(
    silent_stack: LocalStack,
) -> None:
    """The misconfiguration that passes every simulated test: ``tcp://127.0.0.1:P`` makes
    vLLM connect, the tracker's SUB connects too, and no live event ever flows."""
    stack = silent_stack
    with httpx.Client(base_url=stack.layout.entry_url, timeout=120) as client:
        body = chat(2, "is anyone listening?")
        assert client.post("/v1/chat/completions", json=body).status_code == 200

        def silent() -> bool:
            replica = _tracker_health(stack)["replicas"].get("replica-0", {})
            return bool(replica.get("live_silent"))

        _wait(silent, 30, "the tracker noticed the silent live stream")
        where = client.post("/index", json=body).json()["replicas"]["replica-0"]
        assert int(where["matched_tokens"]) >= 3000  # indexed all the same, from replay
        answer = client.post("/v1/chat/completions", json=body)
        cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(answer.headers[PREDICTED_HEADER]) == cached > 0
    metrics = httpx.get(f"http://127.0.0.1:{stack.layout.tracker_port}/metrics").text
    assert 'kvrouter_tracker_replica_live_silent{replica="replica-0"} 1.0' in metrics
    log = (stack.workdir / "tracker.log").read_text()
    assert "live events are silent" in log and "tcp://*:P" in log
