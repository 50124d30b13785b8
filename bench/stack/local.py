"""The local stack started: its processes from its layout, waited for until it is assembled."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.stack.config import StackConfig
from bench.stack.layout import StackLayout
from bench.stack.processes import ProcessGroup, StackError
from bench.stack.redis_servers import wait_sentinels_ready


def _routed_replicas(body: dict[str, Any]) -> int:
    """A router's /health: how many engines it has in rotation."""
    return int(body["replicas"]["healthy"])


class LocalStack:
    """The kvrouter topology as local processes on loopback (what docker-compose.yml deploys).

    Start it with :meth:`start` (or ``with``). Where everything listens is :attr:`layout`'s,
    known after construction; the processes, which a test or benchmark can kill, restart or
    add to, are :attr:`processes`; each logs to its own file in :attr:`workdir`.
    """

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.workdir = config.workdir or Path(tempfile.mkdtemp(prefix="kvrouter-stack-"))
        self.layout = StackLayout(config, self.workdir)
        self.processes = ProcessGroup(self.workdir)
        self._running = False

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
        layout = self.layout
        try:
            for spec in layout.processes():
                self.processes.add(spec)
            deadline = time.monotonic() + timeout_s
            self.processes.start(timeout_s)
            self._wait_assembled(deadline - time.monotonic())
            if layout.redis_replica_port is not None:
                try:
                    wait_sentinels_ready(
                        layout.sentinel_ports,
                        layout.redis_replica_port,
                        max(deadline - time.monotonic(), 1.0),
                    )
                except TimeoutError as exc:
                    raise StackError(str(exc)) from None
            if "haproxy" in self.processes.names():
                self.processes.wait_url(
                    "haproxy", f"{layout.entry_url}/health", deadline - time.monotonic()
                )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """Stop every process (:meth:`ProcessGroup.stop`); their exit codes by name."""
        self._running = False
        return self.processes.stop(timeout_s)

    def _wait_assembled(self, timeout_s: float) -> None:
        layout = self.layout
        checks: list[tuple[str, str, Callable[[dict[str, Any]], int]]] = [
            (name, f"{url}/health", _routed_replicas)
            for name, url in zip(layout.router_names, layout.router_urls, strict=True)
        ]
        if "tracker" in self.processes.names():
            checks.append(
                (
                    "tracker",
                    f"http://127.0.0.1:{self.layout.tracker_port}/health",
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
        deadline = time.monotonic() + timeout_s
        seen = -1
        while seen < want:
            self.processes.check_alive(name)
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
