"""Local processes run as one group: each logs to its own file in a work directory, is waited
for until it answers, and can be killed, restarted or stopped with the others."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx


class StackError(RuntimeError):
    """A process of the stack failed to start or to become healthy."""


@dataclass(frozen=True)
class ProcessSpec:
    """A process to start: its command line and how to tell that it is up.

    :param health: a URL that answers 200 once it serves.
    :param env: set over this process's own environment.
    :param port: waited for until it accepts connections, when there is no health URL.
    """

    name: str
    argv: list[str]
    health: str | None = None
    env: dict[str, str] | None = None
    port: int | None = None


@dataclass
class _Proc:
    spec: ProcessSpec
    log: IO[bytes]
    popen: subprocess.Popen[bytes] | None = None


class ProcessGroup:
    """Processes started under one work directory, each logging to ``<name>.log`` there, and
    stopped together (the local stack's: :class:`~bench.stack.local.LocalStack`)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._procs: dict[str, _Proc] = {}

    def add(self, spec: ProcessSpec) -> None:
        """Take ``spec`` into the group (replacing a process of that name); :meth:`start`
        starts it."""
        log = (self.workdir / f"{spec.name}.log").open("ab")
        self._procs[spec.name] = _Proc(spec, log)

    def start(self, timeout_s: float) -> None:
        """Start every process in the order added and wait until each is up, within
        ``timeout_s`` in all; processes of one kind (replica-0, replica-1, ...) start side by
        side."""
        deadline = time.monotonic() + timeout_s
        for _, group in itertools.groupby(
            self._procs.values(), key=lambda p: p.spec.name.rsplit("-", 1)[0]
        ):
            started = list(group)
            for proc in started:
                self._launch(proc)
            for proc in started:
                self._wait(proc, deadline - time.monotonic())

    def _launch(self, proc: _Proc, extra_args: Sequence[str] = ()) -> None:
        env = proc.spec.env
        proc.popen = subprocess.Popen(
            [*proc.spec.argv, *extra_args],
            env=None if env is None else {**os.environ, **env},
            stdout=proc.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _wait(self, proc: _Proc, timeout_s: float) -> None:
        if proc.spec.health is not None:
            self.wait_url(proc.spec.name, proc.spec.health, timeout_s)
        elif proc.spec.port is not None:
            self._wait_port(proc, proc.spec.port, timeout_s)

    def check_alive(self, name: str) -> None:
        """Raise :class:`StackError`, with the end of its log, if process ``name`` exited."""
        popen = self._procs[name].popen
        if popen is not None and popen.poll() is not None:
            tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
            raise StackError(f"{name} exited with {popen.returncode}:\n{tail}")

    def _wait_port(self, proc: _Proc, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive(proc.spec.name)
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
            time.sleep(0.05)
        raise StackError(f"{proc.spec.name} did not listen on {port} within {timeout_s}s")

    def wait_url(self, name: str, url: str, timeout_s: float) -> None:
        """Until ``url`` answers 200, while process ``name`` runs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive(name)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise StackError(f"{name} not healthy at {url} within {timeout_s}s")

    def spawn(
        self, name: str, argv: list[str], health: str | None, timeout_s: float = 60.0
    ) -> None:
        """Start one more process under the stack's control (stopped with it) and wait for
        ``health`` to answer 200; e.g. a peer router on a router's port (the benchmark)."""
        if name in self._procs:
            self.retire(name)
        self.add(ProcessSpec(name, argv, health))
        proc = self._procs[name]
        self._launch(proc)
        self._wait(proc, timeout_s)

    def retire(self, name: str, timeout_s: float = 15.0) -> int | None:
        """Stop a process started with :meth:`spawn` (SIGTERM, then SIGKILL) and forget it."""
        proc = self._procs.pop(name)
        popen = proc.popen
        if popen is not None and popen.poll() is None:
            popen.terminate()
            try:
                popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        proc.log.close()
        return None if popen is None else popen.returncode

    def pid(self, name: str) -> int | None:
        proc = self._procs.get(name)
        return None if proc is None or proc.popen is None else proc.popen.pid

    def names(self) -> list[str]:
        return list(self._procs)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one process (fault injection) and reap it if it was a kill."""
        proc = self._procs[name]
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                proc.popen.wait(timeout=30)

    def restart(
        self, name: str, timeout_s: float = 60.0, *, extra_args: Sequence[str] = ()
    ) -> None:
        """Start a process again (after :meth:`kill`) and wait until it is healthy.

        :param extra_args: appended to its command line for this start (later flags win),
            e.g. another ``--policy`` for a router (the benchmark does that).
        """
        proc = self._procs[name]
        self._launch(proc, extra_args)
        self._wait(proc, timeout_s)

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM everything in reverse start order; SIGKILL what outlives ``timeout_s``."""
        codes: dict[str, int | None] = {}
        for proc in reversed(list(self._procs.values())):
            popen = proc.popen
            if popen is not None and popen.poll() is None:
                popen.terminate()
                popen.send_signal(signal.SIGCONT)  # a stopped process (SIGSTOP) must run to exit
                try:
                    popen.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait()
            codes[proc.spec.name] = None if popen is None else popen.returncode
            proc.log.close()
        return codes
