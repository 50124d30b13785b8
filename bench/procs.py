"""Local processes for benchmarks and tests: loopback ports, a throwaway redis-server, a
Redis Cluster, and a blocking client for any Redis URL (the Sentinels: :mod:`bench.sentinels`)."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from tracker.core.redis_client import (
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    parse_cluster_url,
    parse_sentinel_url,
)

_PORT_RANGE_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT: Final = 10_000
_FEW_PORTS: Final = 1_000
_pick = random.SystemRandom()  # not the random module's state, which tests may seed
_handed: set[int] = set()  # ports free_ports gave out: this process never gives one twice


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; its default elsewhere)."""
    try:
        low, high = (int(part) for part in _PORT_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32_768, 60_999
    return low, high


def free_port() -> int:
    """A loopback port nothing listens on right now, outside the ephemeral range where that
    leaves room (:func:`free_ports`).

    The port is handed to a process that binds it later. A port the kernel chose (bind to
    0) comes from the ephemeral range, where any outgoing connection meanwhile may take it:
    a test's engine then failed to start with "Address already in use" (CI, 2026-12-04).
    """
    return free_ports(1)


def free_ports(count: int) -> int:
    """A first port such that ``count`` consecutive loopback ports are free right now.

    No port is handed out twice by this process: until a process binds the port it was
    given, a bind test here would find it free and hand it to a second one (CI, 2026-12-05:
    a router's port, picked before its test's engines, was picked again for one of them).
    """
    low, high = _ephemeral_ports()
    firsts = [*range(_LOWEST_PORT, low - count + 1), *range(high + 1, 65_537 - count)]
    if len(firsts) < _FEW_PORTS:
        # The ephemeral range covers (nearly) every port. A random one is still far safer than
        # the kernel's choice: bind(0) elsewhere may hand out the very port just released here.
        firsts = list(range(_LOWEST_PORT, 65_537 - count))
    for _ in range(100):
        first: int = _pick.choice(firsts)
        run = range(first, first + count)
        if _handed.intersection(run) or not _bindable(run):
            continue
        _handed.update(run)
        return first
    raise RuntimeError(f"no run of {count} free loopback ports")


def _bindable(ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()
    return True


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
    """Return once ``host:port`` accepts connections; :class:`TimeoutError` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


def redis_server_argv(port: int, workdir: Path | str, *extra_args: str) -> list[str]:
    """A redis-server on loopback ``port``, without persistence, its files in ``workdir``.

    :raises RuntimeError: redis-server is not installed.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; scripts/install installs it")
    return [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        *extra_args,
    ]


class RedisServer:
    """A throwaway redis-server bound to loopback; can be stopped and restarted empty."""

    def __init__(self, *extra_args: str) -> None:
        self.extra_args = extra_args
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvr-redis-"))
        self.argv = redis_server_argv(self.port, self.dir, *extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def sync_redis(url: str, timeout_s: float = 5.0) -> Iterator[Any]:
    """A blocking client for ``url`` (a server, or the primary a Sentinel URL names), closed
    after: for benchmarks' and tests' checks."""
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        cluster = parse_cluster_url(url)
        node: Any = ClusterNode  # untyped in redis-py's sync cluster module
        nodes = [node(host, port) for host, port in cluster.nodes]
        with RedisCluster(
            startup_nodes=nodes,
            username=cluster.username,
            password=cluster.password,
            socket_timeout=timeout_s,
        ) as client:
            yield client
        return
    if scheme not in SENTINEL_SCHEMES:
        with redis.Redis.from_url(url, socket_timeout=timeout_s) as client:
            yield client
        return
    parsed = parse_sentinel_url(url)
    make: Any = Sentinel  # typed by redis-py only from 8.2 on: either way type-checks
    sentinel = make(
        list(parsed.sentinels),
        sentinel_kwargs={"socket_timeout": timeout_s, "password": parsed.sentinel_password},
    )
    try:
        with sentinel.master_for(
            parsed.service,
            db=parsed.db,
            username=parsed.username,
            password=parsed.password,
            socket_timeout=timeout_s,
        ) as client:
            yield client
    finally:
        for node in sentinel.sentinels:
            node.close()


class RedisClusterNodes:
    """A Redis Cluster on loopback: ``masters`` masters with ``replicas`` replicas each,
    created with ``redis-cli --cluster create``. :attr:`url` is the ``redis+cluster://`` URL
    every kvrouter part accepts."""

    def __init__(self, masters: int = 3, replicas: int = 1) -> None:
        self.masters, self.replicas = masters, replicas
        count = masters * (1 + replicas)
        while True:  # free ports are drawn one by one: the same one may come twice
            # the bus port defaults to port + 10000, past 65535 for a high free port
            bus = [free_port() for _ in range(count)]
            self.nodes = [
                RedisServer(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-port",
                    str(port),
                )
                for port in bus
            ]
            ports = [*bus, *(node.port for node in self.nodes)]
            if len(set(ports)) == len(ports):
                break
            self.close()

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[: self.masters])
        return f"redis+cluster://{hosts}"

    def start(self, timeout_s: float = 30.0) -> RedisClusterNodes:
        try:
            return self._start(timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout_s: float) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=timeout_s,
            check=True,
        )
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:  # every node agrees the cluster is whole
            with redis.Redis(port=node.port, socket_timeout=2.0) as client:
                while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the cluster did not come up")
                    time.sleep(0.05)
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.close()
