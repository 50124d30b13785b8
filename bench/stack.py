"""The kvrouter topology as local processes on loopback: what docker-compose.yml deploys.

redis-server, simulated engines (``kvrouter replica``), one tracker, N routers and haproxy
in TCP (L4) mode in front of the routers — or, in embedded mode, one router with its
in-process tracker and no Redis. Used by the demo, the benchmark and the topology tests;
every process logs to its own file in the work directory.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from bench.procs import redis_server_argv
from bench.sentinels import SENTINEL_SERVICE, sentinel_config, wait_sentinels_ready
from publishers.config import EngineShape
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings, setting


class StackError(RuntimeError):
    """A process of the stack failed to start or to become healthy."""


def kvrouter_bin() -> str:
    """The ``kvrouter`` console script of this interpreter's environment."""
    candidate = Path(sys.executable).parent / "kvrouter"
    return str(candidate) if candidate.exists() else "kvrouter"


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux; else IANA's)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49_152, 65_535


def port_block(count: int, start: int = 20_000, stop: int | None = None) -> int:
    """First port of ``count`` consecutive loopback ports that are free right now.

    The block stays below the ephemeral range (``stop`` defaults to its first port): there,
    the stack's own outgoing connections could take a port between this check and the bind.
    """
    if stop is None:
        low, high = ephemeral_ports()
        start, stop = (start, low) if low - start > count else (high + 1, 65_536)
    if stop - start <= count:
        raise StackError(f"no room for {count} ports in {start}..{stop}")
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
class VllmEngines:
    """Real vLLM engines (its CPU build, ``scripts/vllm-install``) in place of simulated ones.

    :param binary: the ``vllm`` entry point of the virtualenv it is installed in.
    :param model: the model directory served (and the routers' tokenizer and chat template).
    :param num_gpu_blocks: KV-cache blocks per engine (``--num-gpu-blocks-override``); None:
        what ``VLLM_CPU_KVCACHE_SPACE`` holds.
    :param nice: niceness of the engines: vLLM's CPU engine busy-polls, and two of them on a
        2-core machine starve the tracker of the time to apply their events.
    """

    binary: Path
    model: Path
    num_gpu_blocks: int | None = None
    max_model_len: int = 4096
    nice: int = 5
    pin: bool = False  # engine i on core i (taskset): the engines stop competing for cores
    attach: bool = False  # register through kvrouter's vllm.general_plugins shim (needs Redis)
    events_host: str = "*"  # anything but a wildcard makes vLLM connect its PUB socket out
    env: tuple[tuple[str, str], ...] = (
        ("VLLM_TARGET_DEVICE", "cpu"),
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        ("OMP_NUM_THREADS", "1"),
        ("VLLM_SERVER_DEV_MODE", "1"),  # POST /reset_prefix_cache
    )

    def argv(
        self, model: str, block_size: int, port: int, events: int, replay: int, *, index: int = 0
    ) -> list[str]:
        events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds only a wildcard endpoint (and connects to anything else)
            "endpoint": f"tcp://{self.events_host}:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "",
        }
        core = index % (os.cpu_count() or 1)
        argv = [
            *(["taskset", "-c", str(core)] if self.pin else []),
            *(["nice", "-n", str(self.nice)] if self.nice else []),
            str(self.binary),
            "serve",
            str(self.model),
            "--served-model-name",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(block_size),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(events_config),
        ]
        if self.num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return argv


@dataclass(frozen=True, kw_only=True)
class StackConfig(EngineShape):
    """Shape of the local stack; its engines' shape is the :class:`EngineShape` fields."""

    replicas: int = 4
    routers: int = 2
    redis: bool = True
    # Redis as a primary, one replica and three Sentinels (quorum 2): every part gets the
    # redis+sentinel:// URL and follows a failover (the processes are redis, redis-replica,
    # sentinel-0..2)
    sentinel: bool = False
    # > 0: a second tracker on standby (process standby-tracker), both elected by a lease of
    # this many seconds (kvrouter tracker --lease-ttl-s)
    tracker_lease_s: float = 0.0
    haproxy: bool = True
    # each router keeps its own index, fed by every engine's events, and shares only the
    # load through Redis (kvrouter router --local-index)
    local_index: bool = False
    model: str = "default"
    router_args: tuple[str, ...] = ()
    replica_args: tuple[str, ...] = ()
    tracker_args: tuple[str, ...] = ()
    workdir: Path | None = None
    # one `kvrouter replica` process per engine (named replica-0 ..), so that a fault can hit
    # one engine; engine i's id is then replica-i-0 (see LocalStack.replica_ids)
    replica_processes: bool = False
    # real vLLM engines instead (named vllm-0 ..): registered by kvrouter's shim inside vLLM
    # (VllmEngines.attach), or else given to every process with --replica
    vllm: VllmEngines | None = None


@dataclass
class _Proc:
    name: str
    argv: list[str]
    health: str | None
    log: IO[bytes]
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None
    port: int | None = None  # waited for when there is no health URL


def _routed_replicas(body: dict[str, Any]) -> int:
    """A router's /health: how many engines it has in rotation."""
    return int(body["replicas"]["healthy"])


@dataclass
class LocalStack:
    """Start with :meth:`start` (or ``with``); URLs are known after construction."""

    config: StackConfig = field(default_factory=StackConfig)

    def __post_init__(self) -> None:
        cfg = self.config
        self.workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="kvrouter-stack-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        n = cfg.replicas
        base = port_block(4 + 3 * n + 2 * cfg.routers + (4 if cfg.sentinel else 0))
        self.redis_port = base
        self.haproxy_port = base + 1
        self.tracker_port = base + 2
        self.standby_tracker_port = base + 3
        self.replica_port = base + 4
        self.events_port = self.replica_port + n
        self.replay_port = self.events_port + n
        self.router_ports = [self.replay_port + n + i for i in range(cfg.routers)]
        # spare ports beside each router's, for what replaces it (a peer's metrics server)
        self.spare_ports = [p + cfg.routers for p in self.router_ports]
        after = self.replay_port + n + 2 * cfg.routers
        self.redis_replica_port = after if cfg.sentinel else None
        self.sentinel_ports = [after + 1 + i for i in range(3)] if cfg.sentinel else []
        self._procs: dict[str, _Proc] = {}
        self._running = False

    # ------------------------------------------------------------------ addresses

    @property
    def redis_url(self) -> str | None:
        if not self.config.redis:
            return None
        if self.sentinel_ports:
            hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
            return f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}/0"
        return f"redis://127.0.0.1:{self.redis_port}/0"

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

    @property
    def replica_ids(self) -> list[str]:
        """Engine ids, in port order."""
        if self.config.replica_processes:
            return [f"replica-{i}-0" for i in range(self.config.replicas)]
        return [f"replica-{i}" for i in range(self.config.replicas)]

    def replica_specs(self) -> list[str]:
        """``--replica`` flags for the engines (used without Redis)."""
        return [
            f"{self.replica_ids[i]}=tcp://127.0.0.1:{self.events_port + i},"
            f"replay=tcp://127.0.0.1:{self.replay_port + i},url={url}"
            for i, url in enumerate(self.replica_urls)
        ]

    # ------------------------------------------------------------------ lifecycle

    def _add(
        self,
        name: str,
        argv: list[str],
        health: str | None,
        env: dict[str, str] | None = None,
        *,
        port: int | None = None,
    ) -> None:
        log = (self.workdir / f"{name}.log").open("ab")
        self._procs[name] = _Proc(name, argv, health, log, env=env, port=port)

    def _plan(self) -> None:
        cfg, kv = self.config, kvrouter_bin()
        redis_flags = ["--redis", self.redis_url] if self.redis_url else []
        if cfg.redis:
            try:
                argv = redis_server_argv(self.redis_port, self.workdir)
            except RuntimeError as exc:
                raise StackError(str(exc)) from None
            self._add("redis", argv, None, port=self.redis_port)
            if self.redis_replica_port is not None:
                self._plan_sentinels(argv[0])
        if cfg.vllm is not None:
            for i in range(cfg.replicas):
                argv = cfg.vllm.argv(
                    cfg.model,
                    cfg.block_size,
                    self.replica_port + i,
                    self.events_port + i,
                    self.replay_port + i,
                    index=i,
                )
                env = dict(cfg.vllm.env)
                if cfg.vllm.attach and self.redis_url:
                    # the shim inside vLLM heartbeats the registry entry (publishers/vllm.py)
                    env |= {
                        "KVROUTER_ATTACH_REDIS": self.redis_url,
                        "KVROUTER_ATTACH_ID": self.replica_ids[i],
                        "KVROUTER_ATTACH_URL": self.replica_urls[i],
                        "KVROUTER_ATTACH_EVENTS": f"tcp://127.0.0.1:{self.events_port + i}",
                        "KVROUTER_ATTACH_REPLAY": f"tcp://127.0.0.1:{self.replay_port + i}",
                        "KVROUTER_ATTACH_MODEL": cfg.model,
                        "KVROUTER_ATTACH_BLOCK_SIZE": str(cfg.block_size),
                        "KVROUTER_ATTACH_HEARTBEAT_S": "1",
                        "KVROUTER_ATTACH_TTL_S": "5",
                    }
                self._add(f"vllm-{i}", argv, f"{self.replica_urls[i]}/health", env)
        else:
            groups = (
                [(f"replica-{i}", i, 1) for i in range(cfg.replicas)]
                if cfg.replica_processes
                else [("replicas", 0, cfg.replicas)]
            )
            for name, first, count in groups:
                ids = ["--id-prefix", f"replica-{first}-"] if cfg.replica_processes else []
                self._add_replicas(name, first, count, [*ids, *redis_flags])
        # engines nobody registers are given to every process
        static = not cfg.redis or (cfg.vllm is not None and not cfg.vllm.attach)
        every = [f for s in self.replica_specs() for f in ("--replica", s)]
        specs = every if static else []
        vllm_flags = []
        if cfg.vllm is not None:
            model = str(cfg.vllm.model)
            vllm_flags = ["--tokenizer", model, "--chat-template", f"{model}/tokenizer_config.json"]
        if cfg.redis:
            tracker = [kv, "tracker", *redis_flags, "--http-port", str(self.tracker_port)]
            if static:
                tracker += ["--model", cfg.model, "--block-size", str(cfg.block_size), *specs]
            self._plan_trackers([*tracker, *cfg.tracker_args])
        if cfg.local_index and cfg.redis:
            specs = ["--local-index", *every]
        for i, port in enumerate(self.router_ports):
            replicas = [*specs, *vllm_flags]
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

    def _add_replicas(self, name: str, first: int, count: int, flags: list[str]) -> None:
        cfg = self.config
        self._add(
            name,
            [
                kvrouter_bin(),
                "replica",
                "--count",
                str(count),
                "--port",
                str(self.replica_port + first),
                # vLLM's rule: a PUB on a named host connects out, only a wildcard binds;
                # the registered endpoints use --host (127.0.0.1) all the same
                "--events",
                f"tcp://*:{self.events_port + first}",
                "--replay",
                f"tcp://127.0.0.1:{self.replay_port + first}",
                "--model",
                cfg.model,
                *cfg.replica_flags(),
                *flags,
                *cfg.replica_args,
            ],
            f"{self.replica_urls[first + count - 1]}/health",
        )

    def _haproxy_argv(self) -> list[str]:
        binary = shutil.which("haproxy")
        if binary is None:
            raise StackError("haproxy is not installed (scripts/install installs it)")
        servers = "\n".join(
            f"    server router-{i} 127.0.0.1:{p} check inter 500ms fall 2 rise 2"
            for i, p in enumerate(self.router_ports)
        )
        # as deploy/haproxy.cfg: when every router is out (each answers /health 503 because
        # no engine is up), connections still reach them and get a fast OpenAI 503 instead of
        # being cut by haproxy without an answer
        servers += "\n    option allbackups\n" + "\n".join(
            f"    server router-{i}-spare 127.0.0.1:{p} backup"
            for i, p in enumerate(self.router_ports)
        )
        config = self.workdir / "haproxy.cfg"
        config.write_text(
            "global\n    maxconn 4096\n\n"
            "defaults\n    mode tcp\n    timeout connect 2s\n"
            "    timeout client 10m\n    timeout server 10m\n"
            # as deploy/haproxy.cfg: a connection a dead router refuses goes to another one
            "    retries 2\n    option redispatch\n\n"
            f"frontend kvrouter\n    bind 127.0.0.1:{self.haproxy_port}\n"
            "    default_backend routers\n\n"
            "backend routers\n    balance roundrobin\n"
            "    option httpchk GET /health\n"
            f"{servers}\n"
        )
        return [binary, "-db", "-f", str(config)]

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

    def _launch(self, proc: _Proc, extra_args: Sequence[str] = ()) -> None:
        proc.popen = subprocess.Popen(
            [*proc.argv, *extra_args],
            env=None if proc.env is None else {**os.environ, **proc.env},
            stdout=proc.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _plan_trackers(self, argv: list[str]) -> None:
        lease = self.config.tracker_lease_s
        if lease > 0:
            argv = [*argv, "--lease-ttl-s", str(lease)]
        self._add("tracker", argv, f"http://127.0.0.1:{self.tracker_port}/health")
        if lease > 0:  # started once the first one is up: it stands by
            port = self.standby_tracker_port
            standby = [*argv, "--http-port", str(port)]
            self._add("standby-tracker", standby, f"http://127.0.0.1:{port}/health")

    def _plan_sentinels(self, binary: str) -> None:
        assert self.redis_replica_port is not None
        replica_dir = self.workdir / "redis-replica"
        replica_dir.mkdir(exist_ok=True)
        replicaof = ("--replicaof", "127.0.0.1", str(self.redis_port))
        argv = redis_server_argv(self.redis_replica_port, replica_dir, *replicaof)
        self._add("redis-replica", argv, None, port=self.redis_replica_port)
        for i, port in enumerate(self.sentinel_ports):
            conf = sentinel_config(port, self.workdir, self.redis_port, down_after_ms=1000)
            self._add(f"sentinel-{i}", [binary, str(conf), "--sentinel"], None, port=port)

    def _wait(self, proc: _Proc, timeout_s: float) -> None:
        if proc.health is not None:
            self._wait_url(proc.health, timeout_s, proc)
        elif proc.port is not None:
            self._wait_port(proc.port, timeout_s, proc)

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

    def spawn(
        self, name: str, argv: list[str], health: str | None, timeout_s: float = 60.0
    ) -> None:
        """Start one more process under the stack's control (stopped with it) and wait for
        ``health`` to answer 200; e.g. a peer router on a router's port (the benchmark)."""
        if name in self._procs:
            self.retire(name)
        self._add(name, argv, health)
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

    def endpoints(self) -> list[tuple[str, str, str]]:
        """Per engine, in port order: HTTP URL, event (PUB) and replay endpoints to connect to."""
        return [
            (
                url,
                f"tcp://127.0.0.1:{self.events_port + i}",
                f"tcp://127.0.0.1:{self.replay_port + i}",
            )
            for i, url in enumerate(self.replica_urls)
        ]

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
        self._running = False
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
            codes[proc.name] = None if popen is None else popen.returncode
            proc.log.close()
        return codes

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> dict[str, Any]:
        """Where everything listens (for people: ``python -m bench.stack`` prints it)."""
        out: dict[str, Any] = {
            "entry": self.entry_url,
            "routers": self.router_urls,
            "replicas": self.replica_urls,
            "events": [
                f"tcp://127.0.0.1:{self.events_port + i}" for i in range(self.config.replicas)
            ],
            "replay": [
                f"tcp://127.0.0.1:{self.replay_port + i}" for i in range(self.config.replicas)
            ],
            "logs": str(self.workdir),
        }
        if self.redis_url is not None:
            out["redis"] = self.redis_url
            out["tracker"] = f"http://127.0.0.1:{self.tracker_port}"
        return out


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
