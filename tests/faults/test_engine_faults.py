"""Fault drills on the engines: killed mid-stream, crash-restarted, stalled, all down.

Each drill runs the steady workload through haproxy and two routers, injects its fault,
keeps the load on, and then checks: no request lost; clean errors only for requests the
fault made impossible to serve; the engines' hit rate back; the router load board empty;
the index equal to the engines' real caches.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from collections import Counter
from collections.abc import Sequence

import pytest

from tests.faults.conftest import DrillFactory
from tests.faults.drill import ENGINES, Check, Drill, metric_sum, settle
from tests.faults.drill_course import Seen, busiest, run_drill
from tests.faults.results import make_row, record
from tests.faults.workload import Result, Workload, assert_nothing_lost, failures

pytestmark = [pytest.mark.faults, pytest.mark.redis, pytest.mark.timeout(180)]
LONG_TOKENS = 150  # a stream of about 3 s at H200 speed: surely in flight when the fault hits


async def long_streams(
    workload: Workload, groups: Sequence[int], max_tokens: int
) -> tuple[str, list[asyncio.Task[Result]]]:
    """One long stream per group, once each is in flight; and the replica most of them are on.

    That replica is the victim: whatever the policy decided, streams are surely mid-flight
    on it when the fault hits.
    """
    loop = asyncio.get_running_loop()
    answering: list[asyncio.Future[str | None]] = [loop.create_future() for _ in groups]
    tasks = [
        asyncio.create_task(workload.send(g, stream=True, max_tokens=max_tokens, answering=f))
        for g, f in zip(groups, answering, strict=True)
    ]
    async with asyncio.timeout(10):
        replicas = await asyncio.gather(*answering)
    victim = Counter(r for r in replicas if r is not None).most_common(1)[0][0]
    return victim, tasks


async def test_engine_sigkilled_mid_stream(drill_factory: DrillFactory) -> None:
    drill = await drill_factory()
    workload = drill.workload()
    seen = Seen()

    async def fault() -> None:
        seen.victim, seen.streams = await long_streams(workload, range(4), LONG_TOKENS)
        await drill.kill(drill.engine(drill.stack.layout.replica_ids.index(seen.victim)))
        seen.at = time.monotonic()  # the process is gone (reaped)

    marks = await run_drill(workload, fault)
    victim, killed_at = seen.victim, seen.at
    streams = [await t for t in seen.streams]
    dead = drill.stack.layout.replica_ids.index(victim)

    # the long streams that were on the victim ended with an error event, the others finished
    on_victim = [r for r in streams if r.replica == victim]
    assert on_victim, "no long stream was in flight on the killed engine"
    assert all(r.outcome == "clean_error" and r.detail.startswith("stream") for r in on_victim)
    assert all(r.outcome == "completed" for r in streams if r.replica != victim), streams
    results = [*workload.results, *streams]
    assert_nothing_lost(results)
    for r in failures(results):  # only requests in flight on the victim when it died
        assert r.outcome == "clean_error" and r.started <= killed_at, r
        assert r.replica in (victim, None), r
    # both routers took it out of rotation (a refused connection does that at once)
    for i in (0, 1):
        assert await _unhealthy(drill, i, victim), await drill.router_replicas(i)

    checks: dict[int, Check] = {i: "exact" for i in range(ENGINES) if i != dead}
    checks[dead] = "empty"  # its registry entry expired: the tracker forgot its blocks
    alive = [i for i in range(ENGINES) if i != dead]
    _, consistency = await settle(drill, alive, checks)
    row = make_row(
        "1",
        "engine SIGKILLed mid-stream",
        workload,
        marks,
        consistency,
        extra_results=streams,
        notes=(
            f"{len(on_victim)} long stream(s) in flight on the killed engine end with an "
            "OpenAI error event; non-streamed and not-yet-started requests on it are retried "
            "on the next-best replica; its blocks leave the index when its registry entry "
            "expires (--ttl-s 4 in the drill)."
        ),
    )
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


async def test_engine_crash_restarts_with_an_empty_cache(drill_factory: DrillFactory) -> None:
    drill = await drill_factory()
    workload = drill.workload()
    seen = Seen()

    async def fault() -> float:
        seen.victim, _ = busiest(workload, time.monotonic() - 3)
        i = drill.stack.layout.replica_ids.index(seen.victim)
        await drill.kill(drill.engine(i))
        seen.at = time.monotonic()
        await drill.restart(drill.engine(i))  # same ports, new instance, seq from 0, no cache
        return time.monotonic()

    marks = await run_drill(workload, fault)
    victim, killed_at = seen.victim, seen.at
    assert_nothing_lost(workload.results)
    for r in failures(workload.results):  # only requests in flight on the victim when it died
        assert r.outcome == "clean_error" and r.started <= killed_at, r
        assert r.replica in (victim, None), r

    tracker = await drill.tracker_metrics()
    fenced = sum(
        metric_sum(tracker, "kvrouter_tracker_resets_total", cause=cause)
        for cause in ("seq_reset", "instance_change", "expired")
    )
    assert fenced >= 1, "the tracker never noticed the restart"
    # the restarted engine is back in rotation on both routers
    for i in (0, 1):
        await drill.until(
            f"router-{i} routes to {victim} again",
            functools.partial(_healthy, drill, i, victim),
            timeout_s=10,
        )
    _, consistency = await settle(drill, range(ENGINES), dict.fromkeys(range(ENGINES), "exact"))
    row = make_row(
        "2",
        "engine crash-restarts (sequence from 0, empty cache)",
        workload,
        marks,
        consistency,
        notes=(
            "SIGKILL, then the same command again: requests in flight on it end with a clean "
            "error; the tracker fences the old blocks (new registry instance / sequence reset) "
            "and indexes the new cache; the routers take it back after a health check."
        ),
        fences=fenced,
    )
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


async def _healthy(drill: Drill, router: int, replica: str) -> bool:
    seen = await drill.router_replicas(router)
    return replica in seen and bool(seen[replica]["healthy"])


STALL_TIMEOUT_S = 2.0
STALL_S = 6.0


async def test_engine_stalls_timeouts_fire_and_it_leaves_rotation(
    drill_factory: DrillFactory,
) -> None:
    drill = await drill_factory(
        router_args=(
            "--first-byte-timeout-s",
            str(STALL_TIMEOUT_S),
            "--read-timeout-s",
            str(STALL_TIMEOUT_S),
        )
    )
    workload = drill.workload()
    seen = Seen()

    async def fault() -> float:
        seen.victim, seen.streams = await long_streams(workload, range(1), LONG_TOKENS)
        i = drill.stack.layout.replica_ids.index(seen.victim)
        # the process keeps its sockets: connections are accepted, nothing ever answers
        seen.at = time.monotonic()
        await drill.kill(drill.engine(i), signal.SIGSTOP)
        seen.numbers["unhealthy_s"] = await drill.until(
            f"both routers take {seen.victim} out",
            functools.partial(_out_everywhere, drill, seen.victim),
            timeout_s=15,
        )
        await asyncio.sleep(max(0.0, STALL_S - (time.monotonic() - seen.at)))
        await drill.kill(drill.engine(i), signal.SIGCONT)
        return time.monotonic()

    marks = await run_drill(workload, fault)
    victim, stalled_at = seen.victim, seen.at
    streams = [await t for t in seen.streams]
    results = [*workload.results, *streams]
    assert_nothing_lost(results)
    # the stream in flight on it ended with a timeout error event
    assert [r.detail for r in streams] == ["stream upstream_timeout"], streams
    for r in failures(results):  # timeouts of requests sent to the stalled engine only
        assert r.outcome == "clean_error", r
        assert r.detail in ("504 upstream_timeout", "stream upstream_timeout"), r
        assert r.started >= stalled_at - 1 and r.latency_s < STALL_TIMEOUT_S + 1.5, r
    timeouts = len(failures(results))
    assert timeouts >= 1, "no request met the stalled engine"
    for i in (0, 1):
        await drill.until(
            f"router-{i} routes to {victim} again",
            functools.partial(_healthy, drill, i, victim),
            timeout_s=15,
        )
    expired = metric_sum(
        await drill.tracker_metrics(), "kvrouter_tracker_resets_total", cause="expired"
    )
    _, consistency = await settle(drill, range(ENGINES), dict.fromkeys(range(ENGINES), "exact"))
    row = make_row(
        "7",
        "engine stalls (SIGSTOP: accepts, never answers)",
        workload,
        marks,
        consistency,
        extra_results=streams,
        notes=(
            f"routers with --first-byte-timeout-s/--read-timeout-s {STALL_TIMEOUT_S:g}: "
            f"{timeouts} request(s) sent to it get a 504 (or a timeout error event "
            f"mid-stream); both routers took it out of rotation after "
            f"{seen.numbers['unhealthy_s']:.1f} s; after SIGCONT ({STALL_S:g} s) it is healthy "
            "again"
            + (
                "; its registry entry had expired meanwhile: re-indexed from replay."
                if expired
                else "."
            )
        ),
        unhealthy_after_s=round(seen.numbers["unhealthy_s"], 2),
    )
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


async def _unhealthy(drill: Drill, router: int, replica: str) -> bool:
    seen = await drill.router_replicas(router)
    return replica not in seen or not seen[replica]["healthy"]


async def test_every_engine_down_is_a_fast_503_without_pile_up(
    drill_factory: DrillFactory,
) -> None:
    drill = await drill_factory()
    workload = drill.workload()
    state: dict[str, float] = {}

    async def fault() -> float:
        await asyncio.gather(*(drill.kill(drill.engine(i)) for i in range(ENGINES)))
        state["down_at"] = time.monotonic()
        inflight = 0
        while time.monotonic() - state["down_at"] < 4.0:  # no pile-up on the routers meanwhile
            for r in (0, 1):
                inflight = max(inflight, (await drill.router_health(r))["inflight"])
            await asyncio.sleep(0.2)
        state["max_inflight"] = inflight
        await asyncio.gather(*(drill.restart(drill.engine(i)) for i in range(ENGINES)))
        state["restarted_at"] = time.monotonic()
        state["back_s"] = await drill.until(
            "both routers route again", functools.partial(_serving, drill), timeout_s=10
        )
        return state["restarted_at"]

    marks = await run_drill(workload, fault)
    assert_nothing_lost(workload.results)
    down_at, restarted_at = state["down_at"], state["restarted_at"]
    during = [r for r in workload.results if down_at < r.started < restarted_at - 1.0]
    assert during, "no request was sent while every engine was down"
    slow = [r for r in during if r.outcome != "clean_error" or r.latency_s >= 1.0]
    assert not slow, [(r.outcome, r.detail, round(r.latency_s, 3)) for r in slow[:10]]
    assert {r.detail for r in during} <= {"503 no_replica_available"}, {r.detail for r in during}
    back_at = restarted_at + state["back_s"]
    for r in failures(workload.results):  # in flight at the kill, or sent during the outage
        assert r.outcome == "clean_error" and r.started < back_at, (r, back_at)
    assert state["max_inflight"] <= workload.clients, state
    _, consistency = await settle(drill, range(ENGINES), dict.fromkeys(range(ENGINES), "exact"))
    p99 = sorted(r.latency_s for r in during)[int(len(during) * 0.99)]
    row = make_row(
        "8",
        "every engine down (all SIGKILLed, restarted after 4 s)",
        workload,
        marks,
        consistency,
        notes=(
            f"{len(during)} requests sent during the outage all got a 503 "
            f"no_replica_available, p99 {p99 * 1000:.0f} ms; router in-flight peaked at "
            f"{state['max_inflight']:.0f} (the clients' concurrency bounds it) and is 0 after; "
            "the engines come back empty; the routers route again "
            f"{state['back_s']:.1f} s after the engines answer (their next health check)."
        ),
        outage_requests=len(during),
        outage_p99_ms=round(p99 * 1000, 1),
    )
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


async def _serving(drill: Drill) -> bool:
    for i in (0, 1):
        if not (await drill.router_health(i))["replicas"]["healthy"]:
            return False
    return True


async def _out_everywhere(drill: Drill, replica: str) -> bool:
    return all([await _unhealthy(drill, i, replica) for i in (0, 1)])
