"""The stack a fault drill runs on, and what a drill observes about it.

A :class:`Drill` is a :class:`bench.stack.local.LocalStack` of real processes — redis-server, one
``kvrouter replica`` process per simulated engine, the tracker, two routers behind haproxy —
plus probes: the routers' view of replicas and load, the tracker's metrics, each process's
memory, file descriptors and threads, and the consistency check: every engine's real prefix
cache (``GET /kvrouter/cached_blocks``, simulated engines only) against the blocks the Redis
index lists for it. Blocking stack operations run in a thread, so the workload keeps going.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.stack.config import StackConfig
from bench.stack.local import LocalStack
from bench.stack.redis_servers import sentinel_primary_port, sentinel_view, sync_redis
from tests.faults.workload import MODEL, Workload
from tracker.core.blocks import Namespace
from tracker.core.keys import NamespaceKeys, bucket_entries

ENGINES: Final = 4
BLOCK_SIZE: Final = 16
NUM_BLOCKS: Final = 1024  # three groups' prefixes and the requests in flight: caching matters
# H200 speed: a cache miss costs real time (2k-token prefixes: a cold prefill is 60 ms against
# 26 ms for a hit, ../shared/calibration/h200-prefill.json), so the router's learned TTFT model
# values hits and its hit rate means something. With 1k-token prefixes a miss cost ~8 ms more
# than a hit, within the TTFTs' noise: the router rightly stopped caring where the prefixes
# were, and the drills' hit-rate recovery came down to chance. At time scale 0.05 the
# simulated prefill is cheaper than HTTP.
TIME_SCALE: Final = 1.0
REPLICA_TTL_S: Final = 4.0  # registry entries of a dead engine expire this fast in drills
NAMESPACE: Final = Namespace(MODEL, BLOCK_SIZE)
Check = Literal["exact", "subset", "empty"]


def drill_config(
    workdir: Path,
    *,
    router_args: Sequence[str] = (),
    time_scale: float = TIME_SCALE,
    heartbeat_s: float = 1.0,
    ttl_s: float = REPLICA_TTL_S,
    sentinel: bool = False,
    tracker_lease_s: float = 0.0,
) -> StackConfig:
    """Four engines in their own processes (fault hooks on), two routers, haproxy; Redis
    alone or (``sentinel``) as a primary, a replica and three Sentinels; with
    ``tracker_lease_s``, a second tracker on standby."""
    return StackConfig(
        replicas=ENGINES,
        sentinel=sentinel,
        tracker_lease_s=tracker_lease_s,
        routers=2,
        model=MODEL,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        time_scale=time_scale,
        replica_processes=True,
        replica_args=("--faults", "--heartbeat-s", str(heartbeat_s), "--ttl-s", str(ttl_s)),
        router_args=tuple(router_args),
        workdir=workdir,
    )


@dataclass(frozen=True)
class Consistency:
    """The consistency check's verdict: per replica, engine blocks vs indexed blocks."""

    ok: bool
    after_s: float
    replicas: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def unindexed(self) -> int:
        """Blocks engines hold that the index does not list (allowed by a ``subset`` check)."""
        return sum(r["missing"] for r in self.replicas.values())


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text as ``{(sample name, sorted labels): value}``."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_sum(values: dict[tuple[str, Any], float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        value
        for (sample, have), value in values.items()
        if sample == name and all((k, v) in have for k, v in labels.items())
    )


def process_stats(pid: int) -> dict[str, int]:
    """Resident memory (kB), open file descriptors and threads of a live process."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_kb": int(fields["VmRSS"].split()[0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
    }


class Drill:
    """A started stack and the probes of a fault drill."""

    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.http = httpx.AsyncClient(timeout=5.0)
        assert stack.layout.redis_url is not None
        self.redis_url = stack.layout.redis_url

    @property
    def entry_url(self) -> str:
        return self.stack.layout.entry_url

    @property
    def tracker_url(self) -> str:
        return f"http://127.0.0.1:{self.stack.layout.tracker_port}"

    def engine(self, i: int) -> str:
        """Process name of engine ``i``."""
        return f"replica-{i}"

    def replica_id(self, i: int) -> str:
        return self.stack.layout.replica_ids[i]

    def workload(self, **overrides: Any) -> Workload:
        return Workload(self.entry_url, **overrides)

    async def aclose(self) -> None:
        await self.http.aclose()

    # ------------------------------------------------------------------ process control

    async def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        await asyncio.to_thread(self.stack.processes.kill, name, sig)

    async def restart(self, name: str) -> None:
        await asyncio.to_thread(self.stack.processes.restart, name, 30.0)

    async def warm_up(self) -> None:
        """Warm every process's request path before the routers measure anything.

        A fresh engine's first answer is some 60 ms slower (lazy imports); the routers would
        learn that as its speed, and a replica they think slow gets no requests to unlearn
        it with until the evidence fades. So each engine answers one request directly first;
        then one dry-run placement per router opens its Redis connection and loads scripts.
        """
        body = {"model": MODEL, "messages": [{"role": "user", "content": "warm-up"}]}
        for url in self.stack.layout.replica_urls:
            warm = {**body, "max_tokens": 1}
            for stream in (False, True):
                response = await self.http.post(
                    f"{url}/v1/chat/completions", json={**warm, "stream": stream}
                )
                assert response.status_code == 200, response.text
        for url in self.stack.layout.router_urls:
            assert (await self.http.post(f"{url}/index", json=body)).status_code == 200

    # ------------------------------------------------------------------ probes

    async def router_health(self, i: int) -> dict[str, Any]:
        response = await self.http.get(f"{self.stack.layout.router_urls[i]}/health")
        body: dict[str, Any] = response.json()
        return body

    async def router_replicas(self, i: int) -> dict[str, dict[str, Any]]:
        """Router ``i``'s view: replica id -> health and the load every router shares."""
        body = (await self.http.get(f"{self.stack.layout.router_urls[i]}/replicas")).json()
        return {r["id"]: r for r in body["replicas"]}

    async def metrics(self, url: str) -> dict[tuple[str, Any], float]:
        return metric_values((await self.http.get(f"{url}/metrics")).text)

    async def tracker_metrics(self) -> dict[tuple[str, Any], float]:
        return await self.metrics(self.tracker_url)

    async def until(
        self, what: str, check: Callable[[], Awaitable[bool]], timeout_s: float
    ) -> float:
        """Seconds until ``check()`` holds (polled every 0.1 s); AssertionError past the bound."""
        started = time.monotonic()
        while True:
            try:
                if await check():
                    return time.monotonic() - started
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"{what}: not within {timeout_s:g}s")
            await asyncio.sleep(0.1)

    async def load_is_idle(self, routers: Iterable[int] = (0, 1)) -> bool:
        """No request in flight on the routers, and no load left on the shared board."""
        for i in routers:
            if (await self.router_health(i))["inflight"]:
                return False
            for replica in (await self.router_replicas(i)).values():
                if replica["inflight"] or replica["queued_prefill_tokens"]:
                    return False
        return True

    async def engines_idle(self, engines: Iterable[int]) -> bool:
        for i in engines:
            url = self.stack.layout.replica_urls[i]
            if not (await self.http.get(f"{url}/kvrouter/cached_blocks")).json()["idle"]:
                return False
        return True

    def sentinel_primary(self) -> int:
        """The port of the Redis server the stack's Sentinels name as primary now."""
        return sentinel_primary_port(self.stack.layout.sentinel_ports[0])

    def sentinel_views(self) -> dict[int, dict[str, Any]]:
        """Each Sentinel's view of the service (for a failure's message)."""
        return {port: sentinel_view(port) for port in self.stack.layout.sentinel_ports}

    def shared_load(self, router_id: str) -> int:
        """Requests ``router_id`` still holds on the shared load board (unexpired entries)."""
        key = NamespaceKeys(NAMESPACE).load
        with sync_redis(self.redis_url) as client:
            seconds, micros = client.time()
            now_ms = seconds * 1000 + micros // 1000
            entries = client.hgetall(key)
        inflight = 0
        for name, value in entries.items():
            if name.split(b"\x00")[-1].decode() != router_id or len(value) != 32:
                continue
            count, _, expiry, _ = struct.unpack("<dddd", value)
            inflight += int(count) if expiry > now_ms else 0
        return inflight

    async def inject(self, i: int, **fault: int) -> None:
        """``POST /kvrouter/faults`` on engine ``i`` (event loss)."""
        url = f"{self.stack.layout.replica_urls[i]}/kvrouter/faults"
        response = await self.http.post(url, json=fault)
        assert response.status_code == 200, response.text

    def resources(self) -> dict[str, dict[str, int]]:
        """:func:`process_stats` of every running process of the stack."""
        out = {}
        for name in self.stack.processes.names():
            pid = self.stack.processes.pid(name)
            if pid is not None and Path(f"/proc/{pid}").exists():
                out[name] = process_stats(pid)
        return out

    # ------------------------------------------------------------------ consistency

    def indexed(self) -> dict[str, set[int]]:
        """Block keys the Redis index lists for each replica (a full scan; a quiet index)."""
        keys = NamespaceKeys(NAMESPACE)
        held: dict[str, set[int]] = {}
        with sync_redis(self.redis_url) as client:
            rids = {int(rid): name.decode() for name, rid in client.hgetall(keys.rid).items()}
            buckets = list(client.scan_iter(match=f"{keys.block_prefix}*", count=1000))
            pipe = client.pipeline(transaction=False)
            for bucket in buckets:
                pipe.hgetall(bucket)
            for mapping in pipe.execute():
                for block, value in mapping.items():
                    for rid, _ in bucket_entries(value):
                        held.setdefault(rids.get(rid, f"rid-{rid}"), set()).add(
                            int.from_bytes(block, "big")
                        )
        return held

    async def cached(self, i: int) -> set[int]:
        url = f"{self.stack.layout.replica_urls[i]}/kvrouter/cached_blocks"
        return set((await self.http.get(url)).json()["keys"])

    async def consistency(self, checks: dict[int, Check], timeout_s: float = 15.0) -> Consistency:
        """Poll until the index equals every engine's cache (per ``checks``), or time out.

        ``exact``: the index lists exactly the engine's cached blocks; ``subset``: nothing the
        engine does not hold (blocks it holds may be unknown: after an unrecoverable gap);
        ``empty``: nothing at all (a dead engine whose registry entry expired).
        """
        started = time.monotonic()
        while True:
            index = await asyncio.to_thread(self.indexed)
            report: dict[str, dict[str, int]] = {}
            ok = True
            for i, check in checks.items():
                replica = self.replica_id(i)
                cached = set() if check == "empty" else await self.cached(i)
                listed = index.pop(replica, set())
                missing, extra = len(cached - listed), len(listed - cached)
                report[replica] = {
                    "cached": len(cached),
                    "indexed": len(listed),
                    "missing": missing,
                    "extra": extra,
                }
                ok = ok and extra == 0 and (missing == 0 or check == "subset")
            strangers = {name: len(blocks) for name, blocks in index.items() if blocks}
            ok = ok and not strangers
            for name, count in strangers.items():
                report[name] = {"cached": 0, "indexed": count, "missing": 0, "extra": count}
            elapsed = time.monotonic() - started
            if ok or elapsed > timeout_s:
                return Consistency(ok, elapsed, report)
            await asyncio.sleep(0.25)


async def settle(
    drill: Drill,
    engines: Sequence[int],
    checks: dict[int, Check],
    timeout_s: float = 15.0,
    routers: Sequence[int] = (0, 1),
) -> tuple[float, Consistency]:
    """After the workload stopped: seconds until the load board is idle, and the consistency.

    The load board must be empty once no request is in flight; a dead router's share only
    after its lease expired (see the router-kill drill, which waits for that itself).
    """
    await drill.until("engines idle", lambda: drill.engines_idle(engines), timeout_s)
    idle = await drill.until(
        "router load back to 0", lambda: drill.load_is_idle(routers), timeout_s
    )
    return idle, await drill.consistency(checks, timeout_s)
