"""Fault drill of a client that hangs up mid-stream: the router cancels the engine's request."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.faults.conftest import DrillFactory
from tests.faults.drill import ENGINES, metric_sum, settle
from tests.faults.drill_course import Seen, run_drill
from tests.faults.results import make_row, record
from tests.faults.workload import Result, Workload, assert_nothing_lost, failures

pytestmark = [pytest.mark.faults, pytest.mark.redis, pytest.mark.timeout(180)]


async def hang_up(workload: Workload, group: int, chunks: int) -> Result:
    """A stream the client abandons after ``chunks`` events: it closes the connection."""
    body = workload.body(-group - 1, group, stream=True, max_tokens=6000)
    started = time.monotonic()
    read = 0
    async with workload.client().stream("POST", "/v1/chat/completions", json=body) as response:
        replica = response.headers.get("x-kvrouter-replica")
        async for line in response.aiter_lines():
            read += line.startswith("data:")
            if read >= chunks:
                break
    # leaving the block closes the connection (no keep-alive): the router must cancel
    return Result(
        -group - 1,
        group,
        True,
        6000,
        started,
        time.monotonic(),
        "cancelled",
        f"hung up after {read} events",
        response.status_code,
        replica,
    )


async def test_client_disconnect_mid_stream_cancels_the_engine_request(
    drill_factory: DrillFactory,
) -> None:
    drill = await drill_factory()
    workload = drill.workload()
    seen = Seen()

    async def fault() -> None:
        seen.metrics = [await drill.metrics(url) for url in drill.stack.layout.router_urls]
        # 6000 tokens: two minutes of decoding each, unless the engine aborts them
        seen.gone = list(await asyncio.gather(*(hang_up(workload, g, 3) for g in range(3))))
        seen.at = time.monotonic()

    marks = await run_drill(workload, fault, after_s=4.0)
    gone = seen.gone
    assert all(r.status == 200 and r.replica for r in gone), gone
    assert_nothing_lost(workload.results)
    assert not failures(workload.results), failures(workload.results)[:5]
    # the routers counted the disconnects and released their load
    before = seen.metrics
    after = [await drill.metrics(url) for url in drill.stack.layout.router_urls]
    disconnects = sum(
        metric_sum(a, "kvrouter_router_client_disconnects_total")
        - metric_sum(b, "kvrouter_router_client_disconnects_total")
        for a, b in zip(after, before, strict=True)
    )
    assert disconnects >= len(gone), (disconnects, len(gone))
    # the engines dropped the abandoned requests: idle right after the load stopped,
    # long before those 6000-token answers could have finished
    _, consistency = await settle(
        drill, range(ENGINES), dict.fromkeys(range(ENGINES), "exact"), timeout_s=2.0
    )
    since_hang_up = time.monotonic() - seen.at
    row = make_row(
        "9",
        "client disconnects mid-stream",
        workload,
        marks,
        consistency,
        extra_results=gone,
        notes=(
            f"{len(gone)} clients hang up after 3 events of a 6000-token stream (two minutes "
            "of decoding): the routers close the upstream connection, the engines abort the "
            f"requests (every engine idle {since_hang_up:.1f} s after the hang-ups, as soon as "
            "the steady load stopped) and the load board is back to 0."
        ),
    )
    record(row)
    assert consistency.ok, consistency
