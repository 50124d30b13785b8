"""End to end: the real ``kvrouter tracker`` process, a ZMQ publisher, Redis, ``kvrouter lookup``.

The publisher sends a deliberate gap (a batch only in its replay buffer) and then restarts
(sequence reset, different blocks); the tracker must replay and fence, ``kvrouter lookup``
must print the right placement, /metrics must count it, and SIGTERM must end it cleanly.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import KVROUTER, free_port, kvrouter_env
from tests.tracker.publisher import EventPublisher
from tests.tracker.tracking import (
    A_TOKENS,
    B_TOKENS,
    C_TOKENS,
    ROOTS,
    block_a,
    block_b,
    block_c,
    root,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


class TrackerProcess:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [str(KVROUTER), "tracker", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=kvrouter_env(),
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
async def publisher(zctx: zmq.asyncio.Context) -> AsyncIterator[EventPublisher]:
    pub = EventPublisher(
        zctx, f"tcp://127.0.0.1:{free_port()}", replay=f"tcp://127.0.0.1:{free_port()}"
    )
    await pub.start()
    yield pub
    await pub.close()


@pytest.fixture
def tracker_factory(tmp_path: Path) -> Iterator[Any]:
    procs: list[TrackerProcess] = []

    def start(args: list[str]) -> TrackerProcess:
        proc = TrackerProcess(args, tmp_path / f"tracker-{len(procs)}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.close()


async def lookup(redis_url: str, tokens: list[int]) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        str(KVROUTER),
        "lookup",
        "--redis",
        redis_url,
        "--model",
        "m",
        "--block-size",
        "4",
        "--tokens",
        ",".join(map(str, tokens)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=kvrouter_env(),
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out)
    return result


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_tracker_process_replays_fences_and_stops(
    publisher: EventPublisher, redis_url: str, tracker_factory: Any
) -> None:
    port = free_port()
    tracker = tracker_factory(
        [
            "--redis",
            redis_url,
            "--replica",
            f"r1={publisher.endpoint},replay={publisher.replay_endpoint}",
            "--model",
            "m",
            "--block-size",
            "4",
            "--http-port",
            str(port),
            "--replay-timeout-s",
            "1",
            "--log-format",
            "json",
        ]
    )
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=2.0) as http:

        async def replica() -> dict[str, Any]:
            try:
                response = await http.get("/health")
            except httpx.TransportError:
                return {}
            status: dict[str, Any] = response.json()["replicas"].get("r1", {})
            return status

        async def metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            return metric_values((await http.get("/metrics")).text)

        try:
            await wait_until(lambda: _synced(replica()), timeout_s=15, what="tracker up")
            await publisher.wait_subscribed()

            # 1. a gap: seq 1 is only in the replay buffer
            await publisher.publish(block_a())
            await publisher.publish(block_b(), live=False)
            await publisher.publish(block_c())
            await wait_until(lambda: _at_seq(replica(), 2), what="gap replayed")
            placed = await lookup(redis_url, A_TOKENS + B_TOKENS + C_TOKENS)
            assert placed["blocks"] == 4
            assert placed["replicas"]["r1"]["matched_blocks"] == 4
            assert placed["replicas"]["r1"]["matched_tokens"] == 16
            assert (await replica())["wire_era"] == "v0.24.0"  # what the test publisher speaks

            # 2. the engine restarts: seq starts over with other blocks
            await publisher.restart()
            await publisher.wait_subscribed()
            await publisher.publish(root("D"), live=False)
            await publisher.publish(root("E"))

            async def fenced() -> bool:
                values = await metrics()
                reset = values[("kvrouter_tracker_resets_total", (("cause", "seq_reset"),))]
                return reset == 1 and await _at_seq(replica(), 1)

            await wait_until(fenced, what="sequence reset handled")
            assert (await lookup(redis_url, A_TOKENS))["replicas"] == {}
            for name in "DE":
                placed = await lookup(redis_url, ROOTS[name][0])
                assert placed["replicas"]["r1"]["matched_blocks"] == 1

            values = await metrics()
            assert values[("kvrouter_tracker_gaps_total", (("replica", "r1"),))] == 1
            assert values[("kvrouter_tracker_replays_total", (("outcome", "ok"),))] >= 3
            assert values[("kvrouter_tracker_replica_last_seq", (("replica", "r1"),))] == 1
            assert values[("kvrouter_tracker_replica_blocks", (("replica", "r1"),))] == 2
        except BaseException:
            print(tracker.log())
            raise

    loop = asyncio.get_running_loop()
    sent = loop.time()
    tracker.proc.send_signal(signal.SIGTERM)
    code = await loop.run_in_executor(None, lambda: tracker.proc.wait(timeout=10))
    assert code == 0, tracker.log()
    assert loop.time() - sent < 5.0
    assert "tracker stopped" in tracker.log()


async def _synced(status: Any) -> bool:
    return bool((await status).get("synced"))


async def _at_seq(status: Any, seq: int) -> bool:
    return bool((await status).get("last_seq") == seq)
