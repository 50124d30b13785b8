"""Fault drills on the control plane: the tracker, redis-server, a router, and the event path.

Engines keep serving through all of these, so no request may fail (a killed router's
connections excepted: haproxy cannot move a connection already open to it). What may
suffer is routing quality — the engines' hit rate — which must come back, and the index,
which must equal the engines' real caches again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import pytest

from tests.faults.conftest import DrillFactory
from tests.faults.drill import ENGINES, Check, metric_sum, settle
from tests.faults.drill_course import Seen, busiest, run_drill
from tests.faults.results import make_row, record
from tests.faults.workload import Result

pytestmark = [pytest.mark.faults, pytest.mark.redis, pytest.mark.timeout(180)]
OUTAGE_S = 3.0
LEASE_TTL_S = 5.0  # kvrouter router's default --lease-ttl-s
TRACKER_LEASE_S = 2.0
ALL_EXACT: dict[int, Check] = dict.fromkeys(range(ENGINES), "exact")


def assert_all_completed(results: list[Result]) -> None:
    bad = [r for r in results if r.outcome != "completed"]
    assert not bad, [(r.n, r.outcome, r.detail) for r in bad[:10]]


async def test_tracker_sigkilled_and_restarted_catches_up_by_replay(
    drill_factory: DrillFactory,
) -> None:
    drill = await drill_factory()
    workload = drill.workload()

    async def fault() -> float:
        await drill.kill("tracker")
        await asyncio.sleep(OUTAGE_S)  # the engines keep publishing to nobody
        await drill.restart("tracker")
        return time.monotonic()

    marks = await run_drill(workload, fault)
    assert_all_completed(workload.results)
    tracker = await drill.tracker_metrics()
    replayed = metric_sum(tracker, "kvrouter_tracker_messages_total", source="replay")
    replays = metric_sum(tracker, "kvrouter_tracker_replays_total", outcome="ok")
    assert replays >= 1 and replayed >= 1, "the restarted tracker did not catch up by replay"
    assert not metric_sum(tracker, "kvrouter_tracker_resets_total"), "it started blind"
    _, consistency = await settle(drill, range(ENGINES), ALL_EXACT)
    row = make_row(
        "3",
        f"tracker SIGKILLed, restarted after {OUTAGE_S:g} s",
        workload,
        marks,
        consistency,
        notes=(
            "routing goes on from the index as it was (and the routers' predictions); the "
            "restarted tracker resumes each replica from its checkpoint in Redis and replays "
            f"what it missed ({replayed:.0f} batches in {replays:.0f} replays), without "
            "clearing anything."
        ),
        replayed_batches=replayed,
    )
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


async def test_tracker_sigkilled_standby_takes_over_within_its_lease(
    drill_factory: DrillFactory,
) -> None:
    drill = await drill_factory(tracker_lease_s=TRACKER_LEASE_S)
    workload = drill.workload()
    standby = f"http://127.0.0.1:{drill.stack.layout.standby_tracker_port}"

    async def role(url: str) -> str:
        return str((await drill.http.get(f"{url}/health")).json()["role"])

    assert await role(drill.tracker_url) == "active" and await role(standby) == "standby"
    state: dict[str, float] = {}

    async def fault() -> float:
        await drill.kill("tracker")  # no graceful hand-over: the lease must expire
        state["takeover_s"] = await drill.until(
            "the standby took over",
            lambda: _is(role(standby), "active"),
            timeout_s=TRACKER_LEASE_S + 5,
        )
        return time.monotonic()

    marks = await run_drill(workload, fault)
    assert_all_completed(workload.results)
    tracker = await drill.metrics(standby)
    replayed = metric_sum(tracker, "kvrouter_tracker_messages_total", source="replay")
    assert metric_sum(tracker, "kvrouter_tracker_elections_won_total") == 1
    assert replayed >= 1, "the standby did not catch up by replay"
    assert not metric_sum(tracker, "kvrouter_tracker_resets_total"), "it started blind"
    _, consistency = await settle(drill, range(ENGINES), ALL_EXACT)
    row = make_row(
        "3b",
        "tracker SIGKILLed, a standby tracker takes over",
        workload,
        marks,
        consistency,
        notes=(
            f"two trackers elected by a lease in Redis (--lease-ttl-s {TRACKER_LEASE_S:g}); "
            f"the standby won it {state['takeover_s']:.1f} s after the kill, raised every "
            "partition's fencing number (a paused old tracker's writes are refused from "
            "then on) and resumed each replica from its checkpoint by replay "
            f"({replayed:.0f} batches), without clearing anything; routing went on from the "
            "index meanwhile."
        ),
        takeover_s=round(state["takeover_s"], 2),
        replayed_batches=replayed,
    )
    record(row)
    assert state["takeover_s"] <= TRACKER_LEASE_S + 1.5, row
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


async def _is(value: Awaitable[str], expected: str) -> bool:
    return await value == expected


async def test_redis_killed_and_restarted_empty_routers_fail_open_index_rebuilt(
    drill_factory: DrillFactory,
) -> None:
    # kvrouter replica's default heartbeat: the registry stays empty for seconds
    drill = await drill_factory(heartbeat_s=5.0, ttl_s=15.0)
    workload = drill.workload()

    async def fault() -> float:
        await drill.kill("redis")
        await asyncio.sleep(OUTAGE_S)
        await drill.restart("redis")  # no persistence: it comes back empty
        return time.monotonic()

    marks = await run_drill(workload, fault)
    assert_all_completed(workload.results)
    fallbacks = 0.0
    for url in drill.stack.layout.router_urls:
        fallbacks += metric_sum(await drill.metrics(url), "kvrouter_router_fallbacks_total")
    assert fallbacks >= 1, "no request was routed without the index"
    _, consistency = await settle(drill, range(ENGINES), ALL_EXACT)
    row = make_row(
        "4",
        f"redis-server SIGKILLed, restarted empty after {OUTAGE_S:g} s",
        workload,
        marks,
        consistency,
        notes=(
            f"the routers fail open ({fallbacks:.0f} requests placed on load alone, none "
            "failed); engines re-register with their next heartbeat; the tracker, whose "
            "ledgers hold every replica's state, writes it all back and keeps following."
        ),
        fallbacks=fallbacks,
    )
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


async def test_redis_primary_sigkilled_sentinel_promotes_replica_index_exact(
    drill_factory: DrillFactory,
) -> None:
    drill = await drill_factory(sentinel=True)
    workload = drill.workload()
    state: dict[str, float] = {}
    old = drill.stack.layout.redis_port
    assert await asyncio.to_thread(drill.sentinel_primary) == old

    async def fault() -> float:
        await drill.kill("redis")
        # the Sentinels notice (down-after 1 s), agree (quorum 2), elect one of them and
        # promote the replica; every part follows through its redis+sentinel:// URL. The
        # bound leaves room for a Sentinel in TILT mode (its timer starved for 2 s on a
        # loaded host), which acts on nothing for 30 s; the drill's row records the time
        try:
            state["failover_s"] = await drill.until(
                "the Sentinels promoted the replica",
                lambda: asyncio.to_thread(lambda: drill.sentinel_primary() != old),
                timeout_s=60,
            )
        except AssertionError as exc:
            views = await asyncio.to_thread(drill.sentinel_views)
            logs = "\n".join(
                line
                for path in sorted(drill.stack.workdir.glob("sentinel-*.log"))
                for line in path.read_text(errors="replace").splitlines()[-20:]
            )
            raise AssertionError(f"{exc}; the Sentinels' views: {views}\n{logs}") from None
        return time.monotonic()

    marks = await run_drill(workload, fault)
    assert_all_completed(workload.results)
    assert await asyncio.to_thread(drill.sentinel_primary) == drill.stack.layout.redis_replica_port
    fallbacks = 0.0
    for url in drill.stack.layout.router_urls:
        fallbacks += metric_sum(await drill.metrics(url), "kvrouter_router_fallbacks_total")
    tracker = await drill.tracker_metrics()
    reconciled = metric_sum(tracker, "kvrouter_tracker_index_restores_total")
    _, consistency = await settle(drill, range(ENGINES), ALL_EXACT)
    row = make_row(
        "4b",
        "redis primary SIGKILLed, Sentinel promotes its replica",
        workload,
        marks,
        consistency,
        notes=(
            f"the Sentinels promoted the replica {state['failover_s']:.1f} s after the kill "
            "(down-after-milliseconds 1000, quorum 2 of 3); meanwhile the routers failed open "
            f"({fallbacks:.0f} requests placed on load alone, none failed) and the tracker "
            "kept its writes pending; every part follows the new primary through its "
            "redis+sentinel:// URL; the tracker sees a new server (run_id) and reconciles "
            f"every replica with its ledger ({reconciled:.0f} had a difference to write)."
        ),
        failover_s=round(state["failover_s"], 2),
        fallbacks=fallbacks,
        reconciled=reconciled,
    )
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


async def test_router_sigkilled_haproxy_moves_on_and_no_phantom_load(
    drill_factory: DrillFactory,
) -> None:
    drill = await drill_factory()
    workload = drill.workload()
    state: dict[str, float] = {}

    async def fault() -> None:
        await drill.kill("router-0")
        state["killed_at"] = time.monotonic()  # the process is gone (reaped)
        state["phantom"] = await asyncio.to_thread(drill.shared_load, "router-0")
        # its leases were never released: they must expire from the shared board
        state["phantom_s"] = await drill.until(
            "router-0's load expired",
            lambda: asyncio.to_thread(lambda: drill.shared_load("router-0") == 0),
            timeout_s=LEASE_TTL_S + 3,
        )

    marks = await run_drill(workload, fault, after_s=2.0)
    killed_at = state["killed_at"]
    bad = [r for r in workload.results if r.outcome != "completed"]
    # only connections open to router-0 when it died: haproxy sends new ones to router-1
    assert all(r.outcome == "conn_error" and r.started <= killed_at for r in bad), bad[:5]
    _, consistency = await settle(drill, range(ENGINES), ALL_EXACT, routers=(1,))
    row = make_row(
        "5",
        "one router SIGKILLed",
        workload,
        marks,
        consistency,
        notes=(
            f"{len(bad)} request(s) had their connection open to the killed router (visible "
            "transport errors, retryable); haproxy (retries + redispatch) sends every new "
            f"connection to the other router; the {state['phantom']:.0f} request(s) it still "
            f"held on the shared load board expired with its lease after "
            f"{state['phantom_s']:.1f} s (--lease-ttl-s {LEASE_TTL_S:g}): no phantom load."
        ),
        phantom_requests=state["phantom"],
        phantom_gone_s=round(state["phantom_s"], 2),
    )
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row


@pytest.mark.parametrize("kind", ["drop", "lose"])
async def test_lost_events_gap_is_replayed_or_the_replica_resynced(
    drill_factory: DrillFactory, kind: str
) -> None:
    drill = await drill_factory()
    workload = drill.workload()
    seen = Seen()

    async def fault() -> None:
        seen.victim, _ = busiest(workload, time.monotonic() - 3)
        await drill.inject(
            drill.stack.layout.replica_ids.index(seen.victim), **{f"{kind}_events": 3}
        )

    marks = await run_drill(workload, fault)
    assert_all_completed(workload.results)
    victim = seen.victim
    tracker = await drill.tracker_metrics()
    assert metric_sum(tracker, "kvrouter_tracker_gaps_total", replica=victim) >= 1
    checks = dict(ALL_EXACT)
    if kind == "drop":
        assert metric_sum(tracker, "kvrouter_tracker_replays_total", outcome="ok") >= 1
        assert not metric_sum(tracker, "kvrouter_tracker_resets_total")
        fault_id, title = "6a", "3 event batches lost, still in the replay buffer"
    else:
        assert metric_sum(tracker, "kvrouter_tracker_resets_total", cause="unrecoverable_gap")
        # what the engine cached before the gap and still holds cannot be learned again
        checks[drill.stack.layout.replica_ids.index(victim)] = "subset"
        fault_id, title = "6b", "3 event batches lost beyond the replay buffer"
    _, consistency = await settle(drill, range(ENGINES), checks)
    notes = (
        "the tracker sees the sequence gap on the next live batch and replays it from the "
        "engine's buffer: the index is exact again."
        if kind == "drop"
        else "the replay cannot start where the gap does: the tracker clears the replica "
        "(unrecoverable_gap) and continues from what the buffer holds; the index then lists "
        "only blocks the engine really holds, but not the ones cached before the gap that "
        "stay cached (vLLM re-announces a block only when it computes it again)."
    )
    row = make_row(fault_id, title, workload, marks, consistency, notes=notes, victim=victim)
    record(row)
    assert consistency.ok, consistency
    assert row.recovery_s is not None, row
