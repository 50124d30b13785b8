"""``kvrouter router --workers N``: N router processes serving one listening socket.

The supervisor binds the socket once and spawns N workers that accept from it; each is a whole
router with its own id, sharing index, registry and load through Redis as routers on separate
hosts do (the embedded index cannot be shared: there, more than one worker is an error).
Metrics are merged across workers (prometheus_client's multiprocess mode). A worker that dies
is replaced; one that dies twice in a row right after starting stops the pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Final

from router.config import RouterSettings
from router.metrics import MULTIPROC_ENV
from tracker.framework.http import bind

logger = logging.getLogger(__name__)

_CRASH_WINDOW_S: Final = 5.0  # a worker that dies this soon after its start crashed on start-up
_POLL_S: Final = 0.2
_KILL_GRACE_S: Final = 5.0  # past the drain budget, before SIGKILL


def usable_cores() -> int:
    """CPUs this process may run on (its affinity, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_count(settings: RouterSettings) -> int:
    """How many router processes ``settings`` ask for (``--workers 0``: one per core)."""
    return settings.workers or usable_cores()


def _serve_worker(settings: RouterSettings, sock: socket.socket) -> None:
    """A worker's main: one router on the inherited socket until SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor forwards what reaches it
    from router.service import serve  # noqa: PLC0415 - a fresh interpreter imports it
    from tracker.framework import logs  # noqa: PLC0415
    from tracker.framework.lifecycle import run_on_loop  # noqa: PLC0415

    logs.configure(settings.log_level, settings.log_format)
    raise SystemExit(run_on_loop(serve(settings, sock=sock), settings.loop))


class WorkerPool:
    """Start ``count`` workers on one socket, replace the ones that die, drain on a signal."""

    def __init__(self, settings: RouterSettings, count: int) -> None:
        self.settings = settings
        self.count = count
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[tuple[BaseProcess, float] | None] = [None] * count
        self._stops = 0
        self._crashes = 0

    def _settings_of(self, index: int) -> RouterSettings:
        if self.settings.router_id is None:
            return self.settings  # each worker draws its own id (host, pid, random)
        return dataclasses.replace(self.settings, router_id=f"{self.settings.router_id}-{index}")

    def _start(self, index: int, sock: socket.socket) -> None:
        process = self._context.Process(
            target=_serve_worker,
            args=(self._settings_of(index), sock),
            name=f"kvrouter-router-{index}",
        )
        process.start()
        self._workers[index] = (process, time.monotonic())
        logger.info("router worker started", extra={"worker": index, "pid": process.pid})

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stops += 1
        logger.info(
            "router workers stop requested" if self._stops == 1 else "second stop request",
            extra={"signal": signal.Signals(signum).name},
        )
        self._signal_workers(signal.SIGTERM)

    def _signal_workers(self, sig: signal.Signals) -> None:
        for entry in self._workers:
            if entry is not None and entry[0].is_alive() and entry[0].pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(entry[0].pid, sig)

    def run(self) -> int:
        """Serve until SIGINT/SIGTERM; the exit status (0: every worker drained cleanly)."""
        settings = self.settings
        sock = bind(settings.host, settings.port)
        metrics_dir = tempfile.mkdtemp(prefix="kvrouter-metrics-")
        os.environ[MULTIPROC_ENV] = metrics_dir  # inherited by the spawned workers
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            for index in range(self.count):
                self._start(index, sock)
            logger.info(
                "router workers serving",
                extra={
                    "workers": self.count,
                    "host": settings.host,
                    "port": sock.getsockname()[1],
                },
            )
            status = self._supervise(sock)
            return max(status, self._drain())
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            sock.close()
            os.environ.pop(MULTIPROC_ENV, None)
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def _supervise(self, sock: socket.socket) -> int:
        from prometheus_client import multiprocess  # noqa: PLC0415 - needs the env set

        while not self._stops:
            time.sleep(_POLL_S)
            for index, entry in enumerate(self._workers):
                if entry is None or entry[0].is_alive() or self._stops:
                    continue
                process, started = entry
                lived = time.monotonic() - started
                logger.error(
                    "router worker died; starting another",
                    extra={"worker": index, "pid": process.pid, "exitcode": process.exitcode},
                )
                if process.pid is not None:
                    multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]
                self._crashes = self._crashes + 1 if lived < _CRASH_WINDOW_S else 0
                if self._crashes >= 2:
                    logger.error("router workers keep failing at start-up; stopping")
                    self._stops = 1
                    self._signal_workers(signal.SIGTERM)
                    return 1
                self._start(index, sock)
        return 0

    def _drain(self) -> int:
        """Wait for every worker to finish its drain; SIGKILL the ones past the budget."""
        deadline = time.monotonic() + self.settings.shutdown_timeout_s + _KILL_GRACE_S
        status = 0
        for index, entry in enumerate(self._workers):
            if entry is None:
                continue
            process = entry[0]
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.error("router worker did not stop; killing it", extra={"worker": index})
                process.kill()
                process.join()
            if process.exitcode != 0:
                status = 1
        logger.info("router workers stopped", extra={"workers": self.count, "status": status})
        return status
