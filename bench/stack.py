"""The kvrouter topology as local processes on loopback: what docker-compose.yml deploys.

redis-server, simulated engines (``kvrouter replica``), one tracker, N routers and haproxy
in TCP (L4) mode in front of the routers — or, in embedded mode, one router with its
in-process tracker and no Redis. Used by the demo, the benchmark and the topology tests;
every process logs to its own file in the work directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx


class StackError(RuntimeError):
    """A process of the stack failed to start or to become healthy."""


def kvrouter_bin() -> str:
    """The ``kvrouter`` console script of this interpreter's environment."""
    candidate = Path(sys.executable).parent / "kvrouter"
    return str(candidate) if candidate.exists() else "kvrouter"


def port_block(count: int, start: int = 20_000, stop: int = 60_000) -> int:
    """First port of ``count`` consecutive loopback ports that are free right now."""
    base = start + (os.getpid() * 97) % (stop - start - count)
    for _ in range(200):
        if all(_free(base + i) for i in range(count)):
            return base
        base = start + (base - start + count + 17) % (stop - start - count)
    raise StackError(f"no block of {count} free ports")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class StackConfig:
    """Shape of the local stack."""

    replicas: int = 4
    routers: int = 2
    redis: bool = True
    haproxy: bool = True
    model: str = "default"
    block_size: int = 16
    num_blocks: int = 4096
    profile: str = "llama-8b"
    time_scale: float = 1.0
    max_num_batched_tokens: int = 8192
    router_args: tuple[str, ...] = ()
    replica_args: tuple[str, ...] = ()
    workdir: Path | None = None


@dataclass
class _Proc:
    name: str
    argv: list[str]
    health: str | None
    log: IO[bytes]
    popen: subprocess.Popen[bytes] | None = None


@dataclass
class LocalStack:
    """Start with :meth:`start` (or ``with``); URLs are known after construction."""

    config: StackConfig = field(default_factory=StackConfig)

    def __post_init__(self) -> None:
        cfg = self.config
        self.workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="kvrouter-stack-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        n = cfg.replicas
        base = port_block(4 + 3 * n + cfg.routers)
        self.redis_port = base
        self.haproxy_port = base + 1
        self.tracker_port = base + 2
        self.replica_port = base + 4
        self.events_port = self.replica_port + n
        self.replay_port = self.events_port + n
        self.router_ports = [self.replay_port + n + i for i in range(cfg.routers)]
        self._procs: dict[str, _Proc] = {}

    # ------------------------------------------------------------------ addresses

    @property
    def redis_url(self) -> str | None:
        return f"redis://127.0.0.1:{self.redis_port}/0" if self.config.redis else None

    @property
    def router_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.router_ports]

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.replica_port + i}" for i in range(self.config.replicas)]

    @property
    def entry_url(self) -> str:
        """Where clients connect: haproxy when there is one, else the first router."""
        if self.config.haproxy and self.config.routers > 1:
            return f"http://127.0.0.1:{self.haproxy_port}"
        return self.router_urls[0]

    def replica_specs(self) -> list[str]:
        """``--replica`` flags for the engines (used without Redis)."""
        return [
            f"replica-{i}=tcp://127.0.0.1:{self.events_port + i},"
            f"replay=tcp://127.0.0.1:{self.replay_port + i},url={url}"
            for i, url in enumerate(self.replica_urls)
        ]

    # ------------------------------------------------------------------ lifecycle

    def _add(self, name: str, argv: list[str], health: str | None) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self._procs[name] = _Proc(name, argv, health, log)

    def _plan(self) -> None:
        cfg, kv = self.config, kvrouter_bin()
        redis_flags = ["--redis", self.redis_url] if self.redis_url else []
        if cfg.redis:
            redis_server = shutil.which("redis-server")
            if redis_server is None:
                raise StackError("redis-server is not installed (scripts/install installs it)")
            self._add(
                "redis",
                [
                    redis_server,
                    "--port",
                    str(self.redis_port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                ],
                None,
            )
        self._add(
            "replicas",
            [
                kv,
                "replica",
                "--count",
                str(cfg.replicas),
                "--port",
                str(self.replica_port),
                "--events",
                f"tcp://127.0.0.1:{self.events_port}",
                "--replay",
                f"tcp://127.0.0.1:{self.replay_port}",
                "--model",
                cfg.model,
                "--block-size",
                str(cfg.block_size),
                "--num-blocks",
                str(cfg.num_blocks),
                "--profile",
                cfg.profile,
                "--time-scale",
                str(cfg.time_scale),
                "--max-num-batched-tokens",
                str(cfg.max_num_batched_tokens),
                *redis_flags,
                *cfg.replica_args,
            ],
            f"{self.replica_urls[-1]}/health",
        )
        if cfg.redis:
            self._add(
                "tracker",
                [kv, "tracker", *redis_flags, "--http-port", str(self.tracker_port)],
                f"http://127.0.0.1:{self.tracker_port}/health",
            )
        for i, port in enumerate(self.router_ports):
            replicas = (
                [] if cfg.redis else [f for s in self.replica_specs() for f in ("--replica", s)]
            )
            self._add(
                f"router-{i}",
                [
                    kv,
                    "router",
                    "--port",
                    str(port),
                    "--router-id",
                    f"router-{i}",
                    "--model",
                    cfg.model,
                    "--block-size",
                    str(cfg.block_size),
                    *redis_flags,
                    *replicas,
                    *cfg.router_args,
                ],
                f"http://127.0.0.1:{port}/health",
            )
        if cfg.haproxy and cfg.routers > 1:
            self._add("haproxy", self._haproxy_argv(), None)

    def _haproxy_argv(self) -> list[str]:
        binary = shutil.which("haproxy")
        if binary is None:
            raise StackError("haproxy is not installed (scripts/install installs it)")
        servers = "\n".join(
            f"    server router-{i} 127.0.0.1:{p} check inter 500ms fall 2 rise 2"
            for i, p in enumerate(self.router_ports)
        )
        config = self.workdir / "haproxy.cfg"
        config.write_text(
            "global\n    maxconn 4096\n\n"
            "defaults\n    mode tcp\n    timeout connect 2s\n"
            "    timeout client 10m\n    timeout server 10m\n\n"
            f"frontend kvrouter\n    bind 127.0.0.1:{self.haproxy_port}\n"
            "    default_backend routers\n\n"
            "backend routers\n    balance roundrobin\n"
            "    option httpchk GET /health\n"
            f"{servers}\n"
        )
        return [binary, "-db", "-f", str(config)]

    def start(self, timeout_s: float = 60.0) -> LocalStack:
        """Start every process in dependency order and wait until each one is healthy."""
        self._plan()
        try:
            for proc in self._procs.values():
                self._launch(proc)
                self._wait(proc, timeout_s)
            if "haproxy" in self._procs:
                self._wait_url(f"{self.entry_url}/health", timeout_s, self._procs["haproxy"])
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, proc: _Proc) -> None:
        proc.popen = subprocess.Popen(
            proc.argv,
            stdout=proc.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _wait(self, proc: _Proc, timeout_s: float) -> None:
        if proc.health is not None:
            self._wait_url(proc.health, timeout_s, proc)
        elif proc.name == "redis":
            self._wait_port(self.redis_port, timeout_s, proc)

    def _check_alive(self, proc: _Proc) -> None:
        if proc.popen is not None and proc.popen.poll() is not None:
            tail = (self.workdir / f"{proc.name}.log").read_text(errors="replace")[-2000:]
            raise StackError(f"{proc.name} exited with {proc.popen.returncode}:\n{tail}")

    def _wait_port(self, port: int, timeout_s: float, proc: _Proc) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(proc)
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
            time.sleep(0.05)
        raise StackError(f"{proc.name} did not listen on {port} within {timeout_s}s")

    def _wait_url(self, url: str, timeout_s: float, proc: _Proc) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(proc)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise StackError(f"{proc.name} not healthy at {url} within {timeout_s}s")

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

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a process again (after :meth:`kill`) and wait until it is healthy."""
        proc = self._procs[name]
        self._launch(proc)
        self._wait(proc, timeout_s)

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM everything in reverse start order; SIGKILL what outlives ``timeout_s``."""
        codes: dict[str, int | None] = {}
        for proc in reversed(list(self._procs.values())):
            popen = proc.popen
            if popen is not None and popen.poll() is None:
                popen.terminate()
                try:
                    popen.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait()
            codes[proc.name] = None if popen is None else popen.returncode
            proc.log.close()
        return codes

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
