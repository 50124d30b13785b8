"""The kvrouter topology as local processes on loopback: what docker-compose.yml deploys.

redis-server, simulated engines (``kvrouter replica``), one tracker, N routers and haproxy
in TCP (L4) mode in front of the routers — or, in embedded mode, one router with its
in-process tracker and no Redis. Used by the demo, the benchmark and the topology tests;
every process logs to its own file in the work directory. Its shape is a
:class:`~bench.stack_config.StackConfig`, its ports and command lines are
:mod:`bench.stack_layout`'s; this module starts it and waits until it is assembled.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.process_group import StackError
from bench.sentinels import wait_sentinels_ready
from bench.stack_config import StackConfig
from bench.stack_layout import StackLayout
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings, setting


def _routed_replicas(body: dict[str, Any]) -> int:
    """A router's /health: how many engines it has in rotation."""
    return int(body["replicas"]["healthy"])


@dataclass
class LocalStack(StackLayout):
    """Start with :meth:`start` (or ``with``); URLs are known after construction."""

    def start(self, timeout_s: float = 60.0) -> LocalStack:
        """Start every process in dependency order and wait until the stack is assembled.

        Assembled: each process is healthy, the tracker follows every engine's events and
        every router has every engine in rotation (with Redis, they find the engines in the
        registry a moment after their own ``/health`` first answers 200); with Sentinels,
        each of them could fail the primary over. A started stack is
        not started again (``with LocalStack(config).start() as stack`` enters a started
        one: a second start would orphan the first processes, which :meth:`stop` then
        never reaches).
        """
        if self._running:
            return self
        self._running = True
        try:
            self._plan()
            deadline = time.monotonic() + timeout_s
            # processes of one kind (replica-0, replica-1, ...) start side by side
            for _, group in itertools.groupby(
                self._procs.values(), key=lambda p: p.name.rsplit("-", 1)[0]
            ):
                started = list(group)
                for proc in started:
                    self._launch(proc)
                for proc in started:
                    self._wait(proc, deadline - time.monotonic())
            self._wait_assembled(deadline - time.monotonic())
            if self.redis_replica_port is not None:
                try:
                    wait_sentinels_ready(
                        self.sentinel_ports,
                        self.redis_replica_port,
                        max(deadline - time.monotonic(), 1.0),
                    )
                except TimeoutError as exc:
                    raise StackError(str(exc)) from None
            if "haproxy" in self._procs:
                self._wait_url(
                    f"{self.entry_url}/health", deadline - time.monotonic(), self._procs["haproxy"]
                )
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_assembled(self, timeout_s: float) -> None:
        checks: list[tuple[str, str, Callable[[dict[str, Any]], int]]] = [
            (f"router-{i}", f"{url}/health", _routed_replicas)
            for i, url in enumerate(self.router_urls)
        ]
        if "tracker" in self._procs:
            checks.append(
                (
                    "tracker",
                    f"http://127.0.0.1:{self.tracker_port}/health",
                    lambda body: len(body["replicas"]),
                )
            )
        deadline = time.monotonic() + timeout_s
        for name, url, count in checks:
            self.wait_knows_replicas(name, url, deadline - time.monotonic(), count)

    def wait_knows_replicas(
        self,
        name: str,
        url: str,
        timeout_s: float,
        count: Callable[[dict[str, Any]], int] = _routed_replicas,
    ) -> None:
        """Until process ``name`` says at ``url`` (its /health) that it knows every engine
        (``count`` of the body: by default a router's engines in rotation, which it finds in
        the registry or its embedded tracker a moment after /health first answers)."""
        want = self.config.replicas
        proc = self._procs[name]
        deadline = time.monotonic() + timeout_s
        seen = -1
        while seen < want:
            self._check_alive(proc)
            if time.monotonic() > deadline:
                raise StackError(f"{name} knows {seen} of {want} replicas after {timeout_s:.0f}s")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                seen = count(httpx.get(url, timeout=1.0).json())
            if seen < want:
                time.sleep(0.1)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True, kw_only=True)
class StackSettings(Settings):
    """``python -m bench.stack``: the local stack's shape, from flags (defaults: StackConfig's)."""

    PART = "STACK"

    replicas: int = setting(StackConfig.replicas, "simulated engines")
    routers: int = setting(StackConfig.routers, "routers (behind haproxy when more than 1)")
    redis: bool = setting(
        StackConfig.redis, "Redis and a tracker (--no-redis: embedded, one router)"
    )
    haproxy: bool = setting(
        StackConfig.haproxy, "haproxy in front (--no-haproxy: clients talk to router-0)"
    )
    model: str = setting(StackConfig.model, "served model name")
    block_size: int = setting(StackConfig.block_size, "KV-cache block size in tokens")
    num_blocks: int = setting(StackConfig.num_blocks, "KV-cache blocks per engine")
    time_scale: float = setting(StackConfig.time_scale, "multiply every simulated duration")
    workdir: str | None = setting(None, "log directory (default: a new temp dir)")
    timeout_s: float = setting(60.0, "startup budget")

    def config(self) -> StackConfig:
        return StackConfig(
            replicas=self.replicas,
            routers=self.routers if self.redis else 1,
            redis=self.redis,
            haproxy=self.haproxy,
            model=self.model,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            time_scale=self.time_scale,
            workdir=Path(self.workdir) if self.workdir else None,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.stack``: start the local stack, print where it listens, stop on Ctrl-C."""
    settings = parse_argv(StackSettings, argv, prog="python -m bench.stack", description=__doc__)
    config = settings.config()
    stack = LocalStack(config)
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    try:
        stack.start(settings.timeout_s)
        print(json.dumps(stack.describe(), indent=2), flush=True)
        print("stack ready; Ctrl-C stops it", file=sys.stderr, flush=True)
        while not stopping:
            time.sleep(0.2)
    except StackError as exc:
        print(f"bench.stack: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        codes = stack.stop()
    print(f"stopped: {codes}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
