"""The deployed topology as real local processes (:class:`bench.stack.local.LocalStack`):
shared and embedded.

Shared: redis-server, four simulated engines, one tracker, two routers and haproxy in TCP
mode — what docker-compose.yml runs. Requests through haproxy must reach both routers and
still co-locate shared prefixes: each group of prompts sharing a long system prompt lands
on one replica, whose engine reports the prefix as cached, and the index holds that prefix
from the engine's own KV events (not only from the routers' predictions). Embedded: one
router with its in-process tracker and no Redis does the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.stack.config import StackConfig
from bench.stack.local import LocalStack
from router.http.proxy import REPLICA_HEADER

pytestmark = pytest.mark.timeout(60)

MODEL = "default"
BLOCK_SIZE = 16
PREFIX_TOKENS = 1500  # the built-in tokenizer is byte-level: one ASCII character, one token
GROUPS = 4
PER_GROUP = 6
WORDS = ("kv", "cache", "prefix", "router", "block", "event", "replica", "token", "shared")


def system_prompt(group: int) -> str:
    """About PREFIX_TOKENS tokens; groups differ from their first block on."""
    text = f"[group {group}] You answer questions about KV caches. "
    i = group
    while len(text) < PREFIX_TOKENS:
        text += WORDS[i % len(WORDS)] + " "
        i = i * 7 + 3
    return text[:PREFIX_TOKENS]


def chat(group: int, k: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system_prompt(group)},
            {"role": "user", "content": f"question {k} of group {group}: why?"},
        ],
        "max_tokens": 4,
    }


@dataclass(frozen=True)
class Answer:
    replica: str
    prompt_tokens: int
    cached_tokens: int


def send(url: str, body: dict[str, Any]) -> Answer:
    # one connection per request: haproxy (L4) balances connections, not requests
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=20)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return Answer(
        response.headers[REPLICA_HEADER],
        usage["prompt_tokens"],
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
    )


def run_workload(url: str) -> dict[int, list[Answer]]:
    """Every request one after another, group by group.

    Sequential on purpose: with requests in flight, the TTFT policy may rightly send a
    request to an idle replica rather than queue it behind another group's prefill on the
    replica holding its prefix, and that is not what this test is about. Through haproxy's
    round robin, consecutive requests of a group reach different routers.
    """
    return {g: [send(url, chat(g, k)) for k in range(PER_GROUP)] for g in range(GROUPS)}


def router_counters(router_urls: list[str]) -> dict[str, dict[str, float]]:
    """Each router's decisions made without the index or shared load, and its retries."""
    wanted = ("kvrouter_router_fallbacks_total", "kvrouter_router_retries_total")
    out: dict[str, dict[str, float]] = {}
    for url in router_urls:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        out[url] = {
            f"{sample.name}{sorted(sample.labels.items())}": sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name in wanted
        }
    return out


def assert_colocated(answers: dict[int, list[Answer]], router_urls: list[str]) -> None:
    for group, group_answers in answers.items():
        first, rest = group_answers[0], group_answers[1:]
        why = (group, group_answers, router_counters(router_urls))
        assert {a.replica for a in rest} == {first.replica}, why
        for answer in rest:
            # the engine served (at least) the shared prefix from its cache
            assert answer.cached_tokens >= PREFIX_TOKENS - BLOCK_SIZE, why


def assert_indexed_from_events(router_url: str, answers: dict[int, list[Answer]]) -> None:
    """The chosen replica's prefix is in the index as placed by its engine's KV events."""
    prefix_blocks = PREFIX_TOKENS // BLOCK_SIZE
    deadline = time.monotonic() + 10
    for group, group_answers in answers.items():
        replica = group_answers[0].replica
        while True:
            found = httpx.post(f"{router_url}/index", json=chat(group, 0), timeout=5).json()
            match = found["replicas"].get(replica, {})
            confirmed = match.get("matched_blocks", 0) - match.get("predicted_blocks", 0)
            if confirmed >= prefix_blocks:
                break
            assert time.monotonic() < deadline, (group, replica, found["replicas"])
            time.sleep(0.1)


def chat_requests(router_url: str) -> float:
    """``kvrouter_router_requests_total`` of the chat endpoint on one router."""
    text = httpx.get(f"{router_url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvrouter_router_requests_total"
        and sample.labels.get("endpoint") == "chat"
    )


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[LocalStack] = []

    def start(**overrides: Any) -> LocalStack:
        overrides.setdefault("num_blocks", 1024)
        config = StackConfig(
            model=MODEL,
            block_size=BLOCK_SIZE,
            time_scale=0.02,
            # A lookup that overruns its budget (10 ms by default) is answered by load alone
            # (kvrouter_router_fallbacks_total): by design, but on a busy 2-core machine a
            # fresh router's first lookups (connection, script load) can take that long.
            router_args=("--lookup-timeout-ms", "250", *overrides.pop("router_args", ())),
            workdir=tmp_path / f"stack-{len(started)}",
            **overrides,
        )
        stack = LocalStack(config)
        started.append(stack)
        return stack.start(timeout_s=30)

    yield start
    for stack in started:
        stack.stop()


@pytest.mark.redis
def test_haproxy_spreads_over_both_routers_and_prefixes_stay_colocated(
    stack_factory: Any,
) -> None:
    stack: LocalStack = stack_factory(replicas=4, routers=2)
    assert stack.layout.entry_url.endswith(f":{stack.layout.haproxy_port}")

    answers = run_workload(stack.layout.entry_url)

    assert_colocated(answers, stack.layout.router_urls)
    per_router = [chat_requests(url) for url in stack.layout.router_urls]
    assert sum(per_router) == GROUPS * PER_GROUP, per_router
    assert all(count > 0 for count in per_router), per_router
    for url in stack.layout.router_urls:  # both read the same shared index
        assert_indexed_from_events(url, answers)


def test_embedded_router_without_redis_colocates_too(stack_factory: Any) -> None:
    stack: LocalStack = stack_factory(redis=False, routers=1, haproxy=False)
    assert stack.layout.redis_url is None and stack.layout.entry_url == stack.layout.router_urls[0]

    answers = run_workload(stack.layout.entry_url)

    assert_colocated(answers, stack.layout.router_urls)
    assert chat_requests(stack.layout.entry_url) == GROUPS * PER_GROUP
    assert_indexed_from_events(stack.layout.entry_url, answers)


@pytest.mark.redis
def test_two_routers_keep_each_group_home_under_eviction_pressure(stack_factory: Any) -> None:
    """Each cache holds about one group's prefix, three groups share each engine and come
    round in turn, so a prefix is gone before its group returns: the home claims shared
    through Redis keep each group on one engine, whichever router haproxy hands a request
    to. (Without them, ``--home-ttl-s 0``, groups wandered over 2.1-2.3 engines each.)"""
    groups, rounds = 12, 4
    stack: LocalStack = stack_factory(replicas=4, routers=2, num_blocks=120)
    served: dict[int, list[Answer]] = {g: [] for g in range(groups)}
    for k in range(rounds):
        for group in range(groups):
            served[group].append(send(stack.layout.entry_url, chat(group, k)))
    evicted = sum(
        a.cached_tokens < PREFIX_TOKENS - BLOCK_SIZE for g in served.values() for a in g[1:]
    )
    assert evicted >= groups, served  # the pressure is real: homes do not keep the blocks
    engines = {g: {a.replica for a in answers} for g, answers in served.items()}
    spread = sum(len(e) for e in engines.values()) / groups
    why = (engines, router_counters(stack.layout.router_urls))
    assert spread <= 1.25, why
    for answers in served.values():  # and the groups share the engines evenly
        assert sum(a.replica == answers[0].replica for a in answers) >= rounds - 1, why
    assert len({a.replica for answers in served.values() for a in answers}) == 4, why


def test_a_started_stack_entered_again_leaves_no_process_behind(tmp_path: Path) -> None:
    """``with LocalStack(config).start() as stack`` enters a started stack: it must not start
    a second set of processes, whose first set the exit would then leave running."""
    config = StackConfig(
        replicas=1, routers=1, redis=False, haproxy=False, time_scale=0.02, workdir=tmp_path
    )
    with LocalStack(config).start(timeout_s=30) as stack:
        pids = [
            pid
            for name in stack.processes.names()
            if (pid := stack.processes.pid(name)) is not None
        ]
        assert len(pids) == 2  # one engine process, one router
        assert httpx.get(f"{stack.layout.entry_url}/health", timeout=5).status_code == 200
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} outlived the stack"
