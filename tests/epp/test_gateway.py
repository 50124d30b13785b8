"""The endpoint pickers end to end behind a real Envoy (:class:`bench.stack.local.LocalStack`
with a :class:`~bench.stack.config.Gateway`): Redis, simulated engines, the tracker, two
``kvrouter epp`` processes and Envoy's ext_proc filter with an ``override_host`` cluster.

Clients (the OpenAI SDK among them) talk to Envoy only. What the tests read: the engine's own
``x-kvrouter-engine`` header (where a request really ran), the picker's receipt headers, the
usage the engine reports (its prefix cache), and each picker's ``/replicas`` (the load it
reads, shared through Redis) and ``/metrics``. The shared stack serves the tests that leave it
as they found it; the ones that kill a process start their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from bench.stack.config import Gateway, StackConfig
from bench.stack.envoy import MISSING, EnvoyProcess, envoy_binary
from bench.stack.local import LocalStack
from publishers.sim.server import ENGINE_HEADER
from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.procs import free_port
from tests.test_topology import BLOCK_SIZE, MODEL, PREFIX_TOKENS, chat

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(envoy_binary() is None, reason=MISSING),
    pytest.mark.timeout(90),
]

CACHED = PREFIX_TOKENS - BLOCK_SIZE  # the shared prefix, up to its last partial block
SELECTION_HEADER = "test-epp-endpoint-selection"  # GIE conformance: restrict the pick


def stack_config(workdir: Path, **overrides: Any) -> StackConfig:
    options: dict[str, Any] = {
        "replicas": 4,
        "routers": 2,
        "gateway": Gateway(),
        "model": MODEL,
        "block_size": BLOCK_SIZE,
        "num_blocks": 1024,
        # a decode step of 10 ms: a 300-token stream lasts seconds, a short answer 0.1 s
        "time_scale": 0.02,
        "floor_ms": 500.0,
        "workdir": workdir,
    }
    options.update(overrides)
    # as tests/test_topology.py: a fresh picker's first lookups can overrun 10 ms here
    options["router_args"] = ("--lookup-timeout-ms", "250", *options.get("router_args", ()))
    return StackConfig(**options)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The shared stack: four engines, two pickers, Envoy (FULL_DUPLEX_STREAMED both ways)."""
    shared = LocalStack(stack_config(tmp_path_factory.mktemp("gateway")))
    with shared.start(timeout_s=60):
        yield shared


@pytest.fixture
def start_stack(tmp_path: Path) -> Iterator[Callable[..., LocalStack]]:
    """A stack of the test's own (it kills something), stopped after the test."""
    started: list[LocalStack] = []

    def start(**overrides: Any) -> LocalStack:
        started.append(LocalStack(stack_config(tmp_path / f"stack-{len(started)}", **overrides)))
        return started[-1].start(timeout_s=60)

    yield start
    for one in started:
        one.stop()


@pytest.fixture
def second_envoy(tmp_path: Path) -> Iterator[Callable[..., EnvoyProcess]]:
    """Another Envoy in front of a stack's pickers and engines, with other gateway options."""
    started: list[EnvoyProcess] = []

    def start(stack: LocalStack, gateway: Gateway, **ext_proc: Any) -> EnvoyProcess:
        config = stack.layout.envoy_config(gateway)
        assert config.ext_proc is not None
        config = dataclasses.replace(
            config,
            port=free_port(),
            admin_port=free_port(),
            ext_proc=dataclasses.replace(config.ext_proc, **ext_proc),
        )
        envoy = EnvoyProcess(config, tmp_path / f"envoy-{len(started)}")
        started.append(envoy)
        return envoy.start()

    yield start
    for envoy in started:
        envoy.stop()


# ---------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class Answer:
    status: int
    engine: str | None  # where it ran (the engine's own header)
    replica: str | None  # the picker's receipt
    predicted: int
    cached: int
    body: Any


def send(url: str, body: dict[str, Any], **headers: str) -> Answer:
    """One request through the gateway, not streamed."""
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=20)
    return answer_of(response)


def answer_of(response: httpx.Response) -> Answer:
    try:
        body = response.json()
    except ValueError:
        body = response.text
    usage = body.get("usage") if isinstance(body, dict) else None
    details = (usage or {}).get("prompt_tokens_details") or {}
    return Answer(
        response.status_code,
        response.headers.get(ENGINE_HEADER),
        response.headers.get(REPLICA_HEADER),
        int(response.headers.get(PREDICTED_HEADER, "0")),
        details.get("cached_tokens") or 0,
        body,
    )


def address(stack: LocalStack, engine: str) -> str:
    """``127.0.0.1:port`` of an engine id."""
    i = stack.layout.replica_ids.index(engine)
    return stack.layout.replica_urls[i].removeprefix("http://")


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a process's samples named ``name`` whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def inflight(picker_url: str) -> dict[str, int]:
    """Requests in flight per engine as one picker reads the shared load (its /replicas)."""
    body = httpx.get(f"{picker_url}/replicas", timeout=5).json()
    assert body["load_shared"], body
    return {r["id"]: r["inflight"] for r in body["replicas"] if r["inflight"]}


def wait_for(check: Callable[[], bool], within: float, why: Callable[[], object]) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, why()
        time.sleep(0.05)


def released(stack: LocalStack, within: float = 10.0) -> None:
    """Every picker reads no load left anywhere."""
    urls = stack.layout.router_urls
    wait_for(
        lambda: not any(inflight(url) for url in urls),
        within,
        lambda: {url: inflight(url) for url in urls},
    )


def indexed(stack: LocalStack, group: int, engine: str, within: float = 10.0) -> None:
    """Every picker's index holds ``group``'s shared prefix on ``engine`` (events and routes
    reach the pickers asynchronously: on a loaded host a request sent at once can beat them)."""

    def matched(url: str) -> int:
        found = httpx.post(f"{url}/index", json=chat(group, 0), timeout=5).json()
        return int(found["replicas"].get(engine, {}).get("matched_blocks", 0))

    urls = stack.layout.router_urls
    wait_for(
        lambda: all(matched(url) * BLOCK_SIZE >= CACHED for url in urls),
        within,
        lambda: {url: matched(url) for url in urls},
    )


def home_of(stack: LocalStack, group: int, requests: int = 2) -> str:
    """Send ``requests`` of a group through the gateway (sequentially, each after every picker
    knows where the first ran); the one engine they all ran on."""
    url = stack.layout.entry_url
    first = send(url, chat(group, 0)).engine
    assert first is not None
    indexed(stack, group, first)
    engines = {first, *(send(url, chat(group, k)).engine for k in range(1, requests))}
    assert len(engines) == 1 and None not in engines, engines
    return first


def long_stream(group: int, max_tokens: int = 300) -> dict[str, Any]:
    return {**chat(group, 0), "stream": True, "max_tokens": max_tokens}


def alive(stack: LocalStack) -> None:
    """Both pickers still run and answer."""
    for name, url in zip(stack.layout.router_names, stack.layout.router_urls, strict=True):
        stack.processes.check_alive(name)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200


@dataclass
class Sent:
    started: float
    ended: float
    status: int  # 0: the connection broke
    engine: str | None
    replica: str | None


class Load:
    """Small chat requests sent back to back by a few threads until stopped."""

    def __init__(self, url: str, threads: int = 2) -> None:
        self.url = url
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(threads)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self, t: int) -> None:
        k = 0
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                k += 1
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"load {t} {k}"}],
                    "max_tokens": 2,
                }
                started = time.monotonic()
                try:
                    r = client.post(f"{self.url}/v1/chat/completions", json=body)
                    status, headers = r.status_code, r.headers
                except httpx.HTTPError:
                    status, headers = 0, httpx.Headers()
                self.sent.append(
                    Sent(
                        started,
                        time.monotonic(),
                        status,
                        headers.get(ENGINE_HEADER),
                        headers.get(REPLICA_HEADER),
                    )
                )

    def after(self, moment: float) -> list[Sent]:
        return [s for s in self.sent if s.started >= moment]

    def wait_sent(self, count: int, after: float, within: float = 10.0) -> None:
        wait_for(lambda: len(self.after(after)) >= count, within, lambda: self.sent[-5:])


# ---------------------------------------------------------------------------- shared stack


def test_the_openai_sdk_plain_and_streamed_through_envoy(stack: LocalStack) -> None:
    url = f"{stack.layout.entry_url}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=20) as client:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "hello through envoy"}
        ]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=5
        )
        # the picker's receipt names the engine that ran it
        assert raw.headers[REPLICA_HEADER] == raw.headers[ENGINE_HEADER]
        answer = raw.parse()
        assert answer.choices[0].message.content and answer.usage is not None
        assert answer.usage.completion_tokens == 5

        streamed = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert streamed.headers[REPLICA_HEADER] == streamed.headers[ENGINE_HEADER]
        chunks = list(streamed.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len([c for c in chunks if c.choices]) >= 6 and text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

        completion = client.completions.create(model=MODEL, prompt="a prompt", max_tokens=4)
        assert completion.choices[0].text and completion.usage is not None
        pieces = list(
            client.completions.create(model=MODEL, prompt="a prompt", max_tokens=4, stream=True)
        )
        assert "".join(p.choices[0].text for p in pieces if p.choices)
    released(stack)


def test_each_group_of_shared_prefixes_lands_on_its_home_engine(stack: LocalStack) -> None:
    """Each group's first request is sent to an engine of its own (the conformance header):
    the ones after it, free to go anywhere, follow the prefix there. (Left to themselves,
    requests sent one at a time all go to the first engine: every chat prompt shares the
    chat template's first block, and an idle engine holding it is the best choice.)"""
    entry, ids = stack.layout.entry_url, stack.layout.replica_ids
    served: dict[str, list[Answer]] = {}
    for g, home in enumerate(ids):
        group = 10 + g
        first = send(entry, chat(group, 0), **{SELECTION_HEADER: address(stack, home)})
        indexed(stack, group, home)
        served[home] = [first, *(send(entry, chat(group, k)) for k in range(1, 5))]
    for home, answers in served.items():
        assert all(a.status == 200 for a in answers), answers
        assert all(a.engine == a.replica == home for a in answers), (home, answers)
        for answer in answers[1:]:
            # the picker foresaw the hit, and the engine served the prefix from its cache
            assert answer.predicted >= CACHED, (home, answer)
            assert answer.cached >= CACHED, (home, answer)


def test_two_pickers_share_the_requests_and_the_load(stack: LocalStack) -> None:
    urls, entry = stack.layout.router_urls, stack.layout.entry_url
    name = "kvrouter_router_requests_total"
    before = [metric(url, name, endpoint="chat") for url in urls]
    for k in range(6):
        assert send(entry, chat(20, k)).status == 200
    after = [metric(url, name, endpoint="chat") for url in urls]
    assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)
    assert sum(after) - sum(before) == 6

    held = 4
    readers = []  # kept: a line iterator dropped closes its response (httpcore)
    with httpx.Client(timeout=20) as client, contextlib.ExitStack() as streams:
        for g in range(held):
            response = streams.enter_context(
                client.stream("POST", f"{entry}/v1/chat/completions", json=long_stream(21 + g))
            )
            assert response.status_code == 200
            readers.append(response.iter_lines())
            assert next(readers[-1]).startswith("data: ")  # under way

        # each picker holds some of the streams, and reads all of them in the shared load
        def own() -> list[float]:
            return [metric(url, "kvrouter_router_epp_streams") for url in urls]

        wait_for(lambda: all(n >= 1 for n in own()) and sum(own()) == held, 5, own)
        for url in urls:
            wait_for(
                lambda url=url: sum(inflight(url).values()) == held,  # type: ignore[misc]
                5,
                lambda url=url: inflight(url),  # type: ignore[misc]
            )
    released(stack)  # the client left: both pickers release what they booked


def test_a_subset_hint_restricts_the_pick(
    stack: LocalStack, second_envoy: Callable[..., EnvoyProcess]
) -> None:
    entry, group = stack.layout.entry_url, 30
    home = home_of(stack, group)
    other = next(e for e in stack.layout.replica_ids if e != home)
    # the conformance suite's header names the only endpoint allowed
    chosen = send(entry, chat(group, 5), **{SELECTION_HEADER: address(stack, other)})
    assert chosen.status == 200 and chosen.engine == other == chosen.replica, chosen

    # the gateway's own subset hint (envoy.lb.subset_hint metadata, set from a header here)
    envoy = second_envoy(stack, Gateway(), subset_hint_header="x-subset")
    third, fourth = (e for e in stack.layout.replica_ids if e not in (home, other))
    hinted = send(envoy.url, chat(group, 6), **{"x-subset": address(stack, third)})
    assert hinted.status == 200 and hinted.engine == third == hinted.replica, hinted
    pair = {"x-subset": f"{address(stack, fourth)},{address(stack, third)}"}
    assert send(envoy.url, chat(group, 7), **pair).engine in (third, fourth)

    for url, header in ((entry, SELECTION_HEADER), (envoy.url, "x-subset")):
        nowhere = send(url, chat(group, 9), **{header: "127.0.0.1:1"})
        assert nowhere.status == 503, nowhere
        assert nowhere.body["error"]["message"], nowhere.body  # OpenAI-shaped
    released(stack)


# each bad body, and who answers its 400: the picker for what routing reads, the engine for
# what only it judges (the router leaves max_tokens' value to it: router/decide/request.py)
BAD_BODIES = {
    "truncated_json": (b'{"model": "default", "messages": [{"role": "user", "con', "picker"),
    "messages_a_string": (b'{"model": "default", "messages": "hello"}', "picker"),
    "prompt_a_number": (b'{"model": "default", "prompt": 12}', "picker"),
    "model_a_list": (b'{"model": ["default"], "prompt": "hi"}', "picker"),
    "max_tokens_a_string": (
        b'{"model": "default", "messages": [{"role": "user", "content": "hi"}],'
        b' "max_tokens": "many"}',
        "engine",
    ),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_a_bad_body_is_a_400_and_the_pickers_keep_serving(stack: LocalStack, name: str) -> None:
    body, judge = BAD_BODIES[name]
    path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
    response = httpx.post(
        f"{stack.layout.entry_url}{path}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]  # OpenAI-shaped, whoever answered
    assert (ENGINE_HEADER in response.headers) == (judge == "engine"), response.headers
    alive(stack)
    assert send(stack.layout.entry_url, chat(40, 0)).status == 200
    released(stack)


def huge_body(size: int) -> bytes:
    head = b'{"model": "default", "max_tokens": 1, "prompt": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def test_a_40_mb_body_is_a_413_from_the_picker(stack: LocalStack) -> None:
    """FULL_DUPLEX_STREAMED: Envoy streams the body on, the picker refuses past 32 MiB."""
    started = time.monotonic()
    response = httpx.post(
        f"{stack.layout.entry_url}/v1/completions",
        content=huge_body(40 << 20),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 413, response.text[:300]
    assert "error" in response.json()  # the picker's OpenAI body, not Envoy's text
    assert time.monotonic() - started < 20
    alive(stack)
    assert send(stack.layout.entry_url, chat(41, 0)).status == 200
    released(stack)


def test_a_body_over_envoys_buffer_is_a_413_from_envoy_when_buffered(
    stack: LocalStack, second_envoy: Callable[..., EnvoyProcess]
) -> None:
    """BUFFERED: Envoy holds the whole body for the picker, and answers 413 itself once it
    outgrows its buffer (1 MiB by default), before the picker sees any of it."""
    envoy = second_envoy(stack, Gateway(buffered=True))
    response = httpx.post(
        f"{envoy.url}/v1/completions",
        content=huge_body(2 << 20),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 413, response.text[:300]
    assert response.text == "Payload Too Large"  # Envoy's own answer, not the picker's JSON
    alive(stack)
    assert send(envoy.url, chat(42, 0)).status == 200


def test_buffered_and_full_duplex_bodies_route_the_same_way(
    stack: LocalStack, second_envoy: Callable[..., EnvoyProcess]
) -> None:
    buffered = second_envoy(stack, Gateway(buffered=True))
    gateways = (stack.layout.entry_url, buffered.url)
    for group in range(50, 53):
        # a group's requests alternate between the two gateways: one home all the same
        first = send(gateways[0], chat(group, 0))
        assert first.engine is not None, first
        indexed(stack, group, first.engine)
        answers = [first, *(send(gateways[k % 2], chat(group, k)) for k in range(1, 4))]
        assert all(a.status == 200 for a in answers), answers
        assert {a.engine for a in answers} == {answers[0].engine}, answers
        assert all(a.replica == a.engine for a in answers), answers
        assert all(a.cached >= CACHED and a.predicted >= CACHED for a in answers[1:]), answers
    released(stack)


def test_without_the_response_body_requests_still_route_and_stream(
    stack: LocalStack, second_envoy: Callable[..., EnvoyProcess]
) -> None:
    envoy = second_envoy(stack, Gateway(response_body=False))
    group = 60
    home = home_of(stack, group)
    arrivals: list[float] = []
    body = {**chat(group, 1), "stream": True, "max_tokens": 20}
    with httpx.stream("POST", f"{envoy.url}/v1/chat/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        assert r.headers[ENGINE_HEADER] == r.headers[REPLICA_HEADER] == home
        assert int(r.headers[PREDICTED_HEADER]) >= CACHED
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
            lines.append(line)
    assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines, lines[-3:]
    assert len(arrivals) >= 20
    assert arrivals[-1] - arrivals[0] > 0.1  # chunk by chunk, not all at the end
    # the load is released though the picker never sees the end (held until the first token)
    released(stack)


# ---------------------------------------------------------------------------- kills


def test_every_picker_killed_under_load_fails_open_to_cache_blind_requests(
    start_stack: Callable[..., LocalStack],
) -> None:
    stack = start_stack(replicas=2, gateway=Gateway(fail_open=True, buffered=True))
    with Load(stack.layout.entry_url) as load:
        load.wait_sent(6, after=0)
        assert all(s.status == 200 and s.replica for s in load.sent), load.sent
        for name in stack.layout.router_names:
            stack.processes.kill(name)
        killed = time.monotonic()
        load.wait_sent(20, after=killed)
    after = load.after(killed)
    assert all(s.status == 200 and s.engine for s in after), after
    assert not any(s.replica for s in after), after  # no picker placed them
    assert max(s.ended - s.started for s in after) < 3, after


def test_one_picker_killed_under_load_then_the_other_fails_closed(
    start_stack: Callable[..., LocalStack],
) -> None:
    stack = start_stack(replicas=2)
    first, second = stack.layout.router_names
    with Load(stack.layout.entry_url) as load:
        load.wait_sent(6, after=0)
        stack.processes.kill(first)
        killed = time.monotonic()
        load.wait_sent(30, after=killed)
        # the other picker takes every request: Envoy retries a stream the dead one refused,
        # and its health checks stop asking it
        survived = load.after(killed)
        assert all(s.status == 200 and s.replica for s in survived), survived
        stack.processes.kill(second)
        all_dead = time.monotonic()
        load.wait_sent(10, after=all_dead)
    failed = load.after(all_dead)
    assert all(500 <= s.status < 600 for s in failed), failed
    assert max(s.ended - s.started for s in failed) < 3, failed  # a clear error, no hang


def test_an_engine_killed_mid_stream(start_stack: Callable[..., LocalStack]) -> None:
    stack = start_stack(replicas=3, replica_processes=True)
    entry, ids = stack.layout.entry_url, stack.layout.replica_ids
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{entry}/v1/chat/completions", json=long_stream(70, 500), timeout=20
    ) as response:
        victim = response.headers[ENGINE_HEADER]
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        stack.processes.kill(f"replica-{ids.index(victim)}")
        rest: list[str] = []
        with contextlib.suppress(httpx.HTTPError):
            rest.extend(lines)
    # the stream ended (cut short: no [DONE]) instead of hanging
    assert "data: [DONE]" not in rest, rest[-3:]
    assert time.monotonic() - started < 8
    released(stack)
    for k in range(4):
        later = send(entry, chat(71, k))
        assert later.status == 200 and later.engine != victim, later


def test_a_refused_first_choice_is_served_by_the_next_endpoint(
    start_stack: Callable[..., LocalStack],
) -> None:
    # the pickers check engine health once a minute: they cannot learn of the kill before
    # the request, so their first choice is the dead engine, deterministically
    stack = start_stack(
        replicas=3, replica_processes=True, router_args=("--health-interval-s", "60")
    )
    entry, ids, urls = stack.layout.entry_url, stack.layout.replica_ids, stack.layout.router_urls
    group = 80
    home = home_of(stack, group)
    stack.processes.kill(f"replica-{ids.index(home)}", signal.SIGKILL)
    answer = send(entry, chat(group, 5))
    assert answer.status == 200, answer
    assert answer.engine != home and answer.engine is not None, answer
    assert answer.replica == answer.engine  # the picker learnt where it was served
    reroutes = sum(metric(url, "kvrouter_router_epp_reroutes_total", replica=home) for url in urls)
    assert reroutes == 1
    released(stack)
