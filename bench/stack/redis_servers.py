"""Throwaway Redis deployments on loopback for the stack, benchmarks and tests: a server, a
primary with a replica and three Sentinels, a Cluster; and a blocking client for any Redis URL."""

from __future__ import annotations

import contextlib
import shutil
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

from bench.stack.ports import free_port, wait_for_port
from tracker.core.redis_client import (
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    parse_cluster_url,
    parse_sentinel_url,
)

SENTINEL_SERVICE: Final = "kvrouter"


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


def sentinel_config(port: int, workdir: Path, primary_port: int, *, down_after_ms: int) -> Path:
    """A Sentinel's config file (Sentinel rewrites it as it learns; it must be writable)."""
    path = workdir / f"sentinel-{port}.conf"
    path.write_text(
        f"port {port}\n"
        "bind 127.0.0.1\n"
        f"dir {workdir}\n"
        f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary_port} 2\n"
        f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {down_after_ms}\n"
        f"sentinel failover-timeout {SENTINEL_SERVICE} {max(3 * down_after_ms, 3000)}\n"
        f"sentinel parallel-syncs {SENTINEL_SERVICE} 1\n"
    )
    return path


def sentinel_primary_port(sentinel_port: int) -> int:
    """The port of the server the Sentinel on ``sentinel_port`` names as primary now."""
    with redis.Redis(port=sentinel_port, socket_timeout=2.0) as sentinel:
        _, port = sentinel.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
    return int(port)


def sentinel_view(sentinel_port: int) -> dict[str, Any]:
    """What the Sentinel on ``sentinel_port`` knows of the service: its primary's state
    (flags, the other Sentinels it heard of, failover state) and each replica's (flags,
    link to the primary as the replica last reported it)."""
    with redis.Redis(port=sentinel_port, socket_timeout=2.0, decode_responses=True) as sentinel:
        primary = sentinel.sentinel_master(SENTINEL_SERVICE)
        replicas = sentinel.sentinel_slaves(SENTINEL_SERVICE)
    keep = ("port", "flags", "master-link-status", "master-link-down-time", "info-refresh")
    return {
        "primary": {
            k: primary.get(k)
            for k in ("port", "flags", "num-other-sentinels", "failover-state", "config-epoch")
        },
        "replicas": [{k: r.get(k) for k in keep} for r in replicas],
    }


def sentinels_ready(sentinel_ports: list[int], replica_port: int) -> bool:
    """Whether every Sentinel can fail the service over now: it has heard of the other
    Sentinels (the quorum needs them) and last saw the replica linked to the primary (it
    refreshes a replica's state only every 10 s while the primary is up).
    """
    for port in sentinel_ports:
        view = sentinel_view(port)
        if int(view["primary"]["num-other-sentinels"] or 0) < len(sentinel_ports) - 1:
            return False
        if not any(
            int(r["port"]) == replica_port
            and r["master-link-status"] == "ok"
            and "disconnected" not in str(r["flags"])
            for r in view["replicas"]
        ):
            return False
    return True


def wait_sentinels_ready(
    sentinel_ports: list[int], replica_port: int, timeout_s: float = 30.0
) -> None:
    """Return once :func:`sentinels_ready`; :class:`TimeoutError` (with each Sentinel's
    view) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not sentinels_ready(sentinel_ports, replica_port):
        if time.monotonic() > deadline:
            views = {port: sentinel_view(port) for port in sentinel_ports}
            raise TimeoutError(f"the Sentinels are not ready to fail over: {views}")
        time.sleep(0.2)


class RedisSentinels:
    """A primary, one replica of it and three Sentinels (quorum 2) on loopback: the smallest
    Redis deployment that fails over by itself. :attr:`url` is the ``redis+sentinel://`` URL
    every kvrouter part accepts."""

    def __init__(self, *, down_after_ms: int = 1000) -> None:
        self.primary = RedisServer()
        self.replica = RedisServer("--replicaof", "127.0.0.1", str(self.primary.port))
        self.down_after_ms = down_after_ms
        self.sentinel_ports: list[int] = []
        taken = {self.primary.port, self.replica.port}
        while len(self.sentinel_ports) < 3:  # free ports are drawn one by one: no repeats
            port = free_port()
            if port not in taken:
                taken.add(port)
                self.sentinel_ports.append(port)
        self.dir = Path(tempfile.mkdtemp(prefix="kvr-sentinel-"))
        self._sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}/0"

    def start(self) -> RedisSentinels:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; scripts/install installs it")
        self.primary.start()
        self.replica.start()
        for port in self.sentinel_ports:
            conf = sentinel_config(
                port, self.dir, self.primary.port, down_after_ms=self.down_after_ms
            )
            self._sentinels.append(
                subprocess.Popen(
                    [binary, str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port in self.sentinel_ports:
            wait_for_port(port)
        wait_sentinels_ready(self.sentinel_ports, self.replica.port)
        return self

    def primary_port(self) -> int:
        """The port of the server the Sentinels name as primary now."""
        return sentinel_primary_port(self.sentinel_ports[0])

    def wait_replicated(self, timeout_s: float = 10.0) -> None:
        """Return once the replica is linked to the primary."""
        deadline = time.monotonic() + timeout_s
        with redis.Redis(port=self.replica.port, socket_timeout=timeout_s) as client:
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise TimeoutError("the replica did not link to the primary")
                time.sleep(0.05)

    def wait_failover(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Wait until the Sentinels name a primary other than ``old_port``; its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port != old_port:
                return port
            time.sleep(0.1)
        raise TimeoutError(f"no failover away from port {old_port} in {timeout_s} s")

    def close(self) -> None:
        for proc in self._sentinels:
            proc.kill()
            proc.wait(timeout=10)
        self._sentinels.clear()
        self.primary.close()
        self.replica.close()
        shutil.rmtree(self.dir, ignore_errors=True)
