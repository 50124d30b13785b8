"""Benchmark baselines: round-robin, least-load, the seed formula, SGLang's thresholds, oracle."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.baselines import BASELINES, POLICIES, baseline_class, make_baseline
from router.baselines.balance import LeastLoad, RoundRobin
from router.baselines.baseline import Baseline, Choice, Tools, request_text
from router.baselines.oracle import PROBE_PATH, Oracle
from router.baselines.seed import Seed, seed_key
from router.baselines.sglang import SGLang
from router.config import RouterSettings
from router.decide.request import PromptRequest, parse
from router.fleet.replicas import Replica
from router.fleet.upstream import UpstreamClient
from router.shared.load import Load, LocalLoadBoard
from tests.factories import SIM
from tests.router.harness import SYSTEM, base_url, chat, engines, router
from tracker.core.blocks import Namespace
from tracker.framework.errors import ConfigError
from tracker.framework.http import HTTPServer, bind

pytestmark = pytest.mark.timeout(30)
REPLICAS = [Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}", "sim", 16, True) for i in range(3)]


def request(system: str, user: str) -> PromptRequest:
    return parse(json.dumps(chat(system, user)).encode(), "chat")


class Fleet:
    """A load board and shared loads a test sets by hand."""

    def __init__(self) -> None:
        self.board = LocalLoadBoard()
        self.shared: dict[str, Load] = {}

    def busy(self, replica: str, n: int) -> None:
        for _ in range(n):
            self.board.acquire(SIM, replica, 0)

    async def shared_loads(self, namespace: Namespace) -> Mapping[str, Load]:
        return self.shared

    async def token_ids(self, request: PromptRequest, model: str) -> list[int]:
        return list(range(64))


def make(
    kind: type[Baseline], fleet: Fleet, upstream: UpstreamClient | None = None, **settings: Any
) -> Baseline:
    upstream = upstream or UpstreamClient(connect_timeout_s=1.0, max_connections=16)
    tools = Tools(fleet.board, fleet.shared_loads, fleet.token_ids, upstream)
    return kind(RouterSettings(**settings), tools, random.Random(0))


async def pick(policy: Baseline, req: PromptRequest, replicas: list[Replica] = REPLICAS) -> str:
    decision, _ = await policy.choose(Choice(req, "sim", SIM, replicas), {})
    return decision.replica


async def test_round_robin_cycles_in_id_order() -> None:
    policy = make(RoundRobin, Fleet())
    picks = [await pick(policy, request("s", str(i))) for i in range(7)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]


async def test_least_load_reads_the_shared_board() -> None:
    fleet = Fleet()
    fleet.shared = {"r0": Load(3), "r1": Load(1), "r2": Load(2)}
    assert await pick(make(LeastLoad, fleet), request("s", "q")) == "r1"


def test_seed_key_is_the_system_prompt_plus_n_user_characters() -> None:
    a, b = request("sys", "hello world"), request("sys", "help me")
    assert seed_key(a, 0) == seed_key(b, 0)
    assert seed_key(a, 3) == seed_key(b, 3)  # "hel"
    assert seed_key(a, 4) != seed_key(b, 4)
    assert seed_key(a, 0) != seed_key(request("other", "hello world"), 0)


@pytest.mark.parametrize(("inflight", "stays"), [(0, True), (9, True), (11, False)])
async def test_seed_score_is_100_cached_minus_10_in_flight(inflight: int, stays: bool) -> None:
    fleet = Fleet()
    policy = make(Seed, fleet)
    first = await pick(policy, request("sys", "q1"), REPLICAS[:2])
    fleet.busy(first, inflight)
    decision, _ = await policy.choose(Choice(request("sys", "q2"), "sim", SIM, REPLICAS[:2]), {})
    assert {s.replica: s.score for s in decision.scores}[first] == 100 - 10 * inflight
    assert (decision.replica == first) == stays


async def test_seed_prefers_the_replica_that_saw_the_key() -> None:
    fleet = Fleet()
    policy = make(Seed, fleet)
    first = await pick(policy, request("sys", "q1"))
    assert {await pick(policy, request("sys", f"q{i}")) for i in range(10)} == {first}


async def test_sglang_follows_a_match_above_the_cache_threshold() -> None:
    fleet = Fleet()
    policy = make(SGLang, fleet)
    system = "x" * 70
    first = await pick(policy, request(system, "a" * 29))
    fleet.busy(first, 5)  # balanced enough: 5 - 0 <= 64
    # 71 of 100 characters match (> 0.3): the holder wins despite its load
    assert await pick(policy, request(system, "b" * 29)) == first


async def test_sglang_goes_least_loaded_at_or_below_the_threshold() -> None:
    fleet = Fleet()
    policy = make(SGLang, fleet)
    first = await pick(policy, request("x" * 29, "a" * 70))
    fleet.busy(first, 1)
    # "x"*29 + " " = 30 of 100 characters: not above 0.3 -> least loaded, not the holder
    assert await pick(policy, request("x" * 29, "b" * 70)) != first


@pytest.mark.parametrize(
    ("loads", "imbalanced"),
    [((65, 0), True), ((64, 0), False), ((200, 134), False), ((200, 133), True)],
)
async def test_sglang_balance_thresholds_64_and_1_5(
    loads: tuple[int, int], imbalanced: bool
) -> None:
    fleet = Fleet()
    policy = make(SGLang, fleet)
    holder = await pick(policy, request("x" * 90, "a" * 10), REPLICAS[:2])
    other = next(r.id for r in REPLICAS[:2] if r.id != holder)
    fleet.busy(holder, loads[0])
    fleet.busy(other, loads[1])
    chosen = await pick(policy, request("x" * 90, "b" * 10), REPLICAS[:2])
    assert chosen == (other if imbalanced else holder)


def test_sglang_routes_on_message_text_joined_by_spaces() -> None:
    assert request_text(request("sys", "user")) == "sys user"
    raw = parse(b'{"model": "sim", "prompt": "abc"}', "completions")
    assert request_text(raw) == "abc"


class Probed:
    """Engines that answer ``POST /kvrouter/probe`` with set answers; records what they got."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.bodies: list[dict[str, Any]] = []

    def app(self, answer: dict[str, Any]) -> Starlette:
        async def probe(request: Request) -> Response:
            self.paths.append(request.url.path)
            self.bodies.append(json.loads(await request.body()))
            return JSONResponse(answer)

        return Starlette(routes=[Route(PROBE_PATH, probe, methods=["POST"])])


@contextlib.asynccontextmanager
async def probed(answers: Sequence[dict[str, Any]]) -> AsyncIterator[tuple[Probed, list[Replica]]]:
    """A real HTTP server per answer, and replicas ``r0``, ``r1``, ... pointing at them."""
    seen = Probed()
    async with contextlib.AsyncExitStack() as stack:
        replicas = []
        for i, answer in enumerate(answers):
            http = HTTPServer(seen.app(answer), bind("127.0.0.1", 0), shutdown_timeout_s=1)
            await http.start()
            stack.push_async_callback(http.stop)
            url = f"http://127.0.0.1:{http.port}"
            replicas.append(Replica(f"r{i}", url, "sim", 16, True))
        yield seen, replicas


async def test_oracle_picks_the_lowest_expected_ttft_the_engines_report() -> None:
    answers = [
        {"expected_ttft_ms": ttft, "expected_cached_tokens": cached}
        for ttft, cached in zip((80.0, 25.0, 60.0), (0, 2048, 0), strict=True)
    ]
    upstream = UpstreamClient(connect_timeout_s=1.0, max_connections=16)
    async with probed(answers) as (engines_seen, replicas):
        try:
            policy = make(Oracle, Fleet(), upstream)
            choice = Choice(request("s", "q"), "sim", SIM, replicas)
            decision, tokens = await policy.choose(choice, {})
        finally:
            await upstream.aclose()
    assert decision.replica == "r1" and tokens == 64
    assert decision.chosen.matched_tokens == 2048
    assert engines_seen.paths == ["/kvrouter/probe"] * 3
    assert [body["token_ids"] for body in engines_seen.bodies] == [list(range(64))] * 3


def test_the_registry_names_kvrouter_first_then_the_baselines() -> None:
    assert POLICIES == ("ttft", "linear", "round-robin", "least-load", "seed", "sglang", "oracle")
    assert BASELINES == ("round-robin", "least-load", "seed", "sglang", "oracle")
    assert baseline_class("ttft") is None and baseline_class("linear") is None
    for name in BASELINES:
        kind = baseline_class(name)
        assert kind is not None and issubclass(kind, Baseline) and kind.name == name
    assert RouterSettings.from_env({"KVROUTER_ROUTER_POLICY": "oracle"}).policy == "oracle"
    with pytest.raises(ConfigError):
        RouterSettings.from_env({"KVROUTER_ROUTER_POLICY": "nearest"})


def test_policy_names_and_settings() -> None:
    assert make_baseline(RouterSettings(policy="ttft"), None, random.Random()) is None  # type: ignore[arg-type]
    for name in ("round-robin", "least-load", "seed", "sglang", "oracle"):
        settings = RouterSettings(policy=name)
        baseline = make_baseline(settings, None, random.Random())  # type: ignore[arg-type]
        assert baseline is not None and baseline.name == name
    with pytest.raises(ConfigError):
        RouterSettings(sglang_cache_threshold=1.5)
    with pytest.raises(ConfigError):
        RouterSettings(sglang_balance_rel_threshold=0.5)


async def test_the_router_runs_a_baseline_on_the_real_proxy_path() -> None:
    async with (
        engines(3) as fleet,
        router(replica=fleet.specs, policy="round-robin") as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        replicas = []
        for i in range(6):
            answer = await client.post("/v1/chat/completions", json=chat(SYSTEM, f"q{i}"))
            assert answer.status_code == 200, answer.text
            assert float(answer.headers["x-kvrouter-decision-ms"]) >= 0
            replicas.append(answer.headers["x-kvrouter-replica"])
        assert replicas == ["replica-0", "replica-1", "replica-2"] * 2
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_the_oracle_probes_real_engines_and_follows_their_caches() -> None:
    async with (
        engines(3) as fleet,
        router(replica=fleet.specs, policy="oracle") as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        first = await client.post("/v1/chat/completions", json=chat(SYSTEM, "one"))
        holder = first.headers["x-kvrouter-replica"]
        for i in range(4):
            answer = await client.post("/v1/chat/completions", json=chat(SYSTEM, f"q{i}"))
            assert answer.headers["x-kvrouter-replica"] == holder
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
