"""Redis clients from a URL: one server, the primary that a Sentinel quorum names, or a cluster.

Every part opens Redis here (through :meth:`tracker.core.redis_index.RedisIndex.from_url`), so a
URL works the same for the tracker, the routers, the replicas' registration and
``kvrouter lookup`` (the URL forms: :func:`open_redis`).
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from tracker.framework.errors import ConfigError, IndexUnavailableError
from tracker.framework.settings import redact_url

SENTINEL_PORT: Final = 26379
REDIS_PORT: Final = 6379
CLUSTER_SCHEMES: Final = {"redis+cluster": False, "rediss+cluster": True}
SENTINEL_SCHEMES: Final = {"redis+sentinel": False, "rediss+sentinel": True}
# redis-py types Sentinel from 8.2 on; called through Any, the code type-checks on either side
_SENTINEL: Any = Sentinel


async def redis_call(what: str, coro: Awaitable[Any]) -> Any:
    """Await a Redis command; any Redis or socket failure becomes
    :class:`~tracker.framework.errors.IndexUnavailableError` naming ``what`` failed."""
    try:
        return await coro
    except (RedisError, OSError) as exc:
        raise IndexUnavailableError(f"redis {what} failed: {exc}") from exc


def retry() -> Retry:
    """One immediate retry on a fresh connection: pooled connections are stale after a Redis
    restart or a failover, and every write of the index is idempotent, so a replay is safe."""
    return Retry(NoBackoff(), 1, (RedisConnectionError,))


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse a ``redis+sentinel://`` URL.

    :raises ConfigError: if it is not one, or names no Sentinel or no service.
    """
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ConfigError(f"not a Sentinel URL (redis+sentinel://…): {shown!r}")
    username, password, sentinels = _credentials_and_nodes(parts.netloc, SENTINEL_PORT, shown)
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ConfigError(f"a Sentinel URL ends in /service or /service/db: {shown!r}")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise ConfigError(f"bad database number {path[1]!r} in {shown!r}")
        db = int(path[1])
    query = parse_qs(parts.query)
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise ConfigError(f"unknown Sentinel URL option(s) {sorted(unknown)} in {shown!r}")
    sentinel_password = query.get("sentinel_password", [None])[-1]
    return SentinelURL(
        sentinels=tuple(sentinels),
        service=unquote(path[0]),
        db=db,
        username=username,
        password=password,
        sentinel_password=sentinel_password,
        ssl=SENTINEL_SCHEMES[parts.scheme],
    )


@dataclass(frozen=True, slots=True)
class ClusterURL:
    """A parsed ``redis+cluster://`` URL."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def parse_cluster_url(url: str) -> ClusterURL:
    """Parse a ``redis+cluster://`` URL.

    :raises ConfigError: if it is not one, names no node, or has a path or options.
    """
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ConfigError(f"not a Redis Cluster URL (redis+cluster://…): {shown!r}")
    if parts.path.strip("/") or parts.query:
        raise ConfigError(f"a Redis Cluster URL has no database or options: {shown!r}")
    username, password, nodes = _credentials_and_nodes(parts.netloc, REDIS_PORT, shown)
    return ClusterURL(tuple(nodes), username, password, CLUSTER_SCHEMES[parts.scheme])


def _credentials_and_nodes(
    netloc: str, default_port: int, shown: str
) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    credentials, _, hosts = netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    nodes = [_host_port(node, default_port, shown) for node in hosts.split(",")]
    return unquote(username) or None, unquote(password) or None, nodes


def _host_port(node: str, default_port: int, shown: str) -> tuple[str, int]:
    if not node:
        raise ConfigError(f"empty address in {shown!r}")
    if node.startswith("["):  # [::1]:26379
        host, _, rest = node[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = node.rpartition(":") if ":" in node else (node, "", "")
    if not host:
        raise ConfigError(f"empty host in {shown!r}")
    if not port:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"bad port {port!r} in {shown!r}")
    return host, int(port)


@dataclass
class RedisConnection:
    """An open client and whatever else must be closed with it (the Sentinel clients)."""

    client: redis.Redis
    sentinel: Sentinel | None = None
    service: str | None = None

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.sentinel is not None:
            for client in self.sentinel.sentinels:
                await client.aclose()


def open_redis(url: str, *, timeout_s: float = 2.0) -> RedisConnection:
    """A client for ``url``; connects on first use.

    * ``redis://[[user]:password@]host[:port][/db]``, ``rediss://…`` (TLS), ``unix:///path``:
      redis-py's own URL forms.
    * ``redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/service[/db]`` (and
      ``rediss+sentinel://`` for TLS to the servers): the Sentinels to ask (port 26379 by
      default) and the name of the monitored primary. The user and password are the data
      servers'; ``?sentinel_password=…`` authenticates to the Sentinels if they need it. The
      client asks the Sentinels for the primary on every new connection, so after a failover
      the next command (one retry, see :func:`retry`) reaches the promoted replica; a demoted
      primary's ``READONLY`` answer also sends it back to the Sentinels.
    * ``redis+cluster://[[user]:password@]host[:port][,host[:port]…]`` (and ``rediss+cluster://``):
      startup nodes of a Redis Cluster (port 6379 by default). redis-py's cluster client learns
      the slot map from them, sends each command to the master of its key's slot and follows
      ``MOVED`` and ``ASK``. Every script call of kvrouter's touches one partition, and every
      partition is one slot, so partitions of different models spread over the masters.

    redis-py has no URL form for Sentinel; the scheme is the one Celery, Kombu and several Redis
    clients for other languages accept, with the service name as the path. Cluster URLs follow
    it (``redis://`` alone cannot say "cluster": a cluster node answers plain commands too, with
    ``MOVED`` for every key it does not own).

    :raises ConfigError: if the URL is malformed.
    """
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        cluster = parse_cluster_url(url)
        nodes = [ClusterNode(host, port) for host, port in cluster.nodes]
        client: Any = RedisCluster(
            startup_nodes=nodes,
            username=cluster.username,
            password=cluster.password,
            ssl=cluster.ssl,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
        return RedisConnection(client)
    if scheme in SENTINEL_SCHEMES:
        parsed = parse_sentinel_url(url)
        sentinel: Sentinel = _SENTINEL(
            list(parsed.sentinels),
            sentinel_kwargs={
                "socket_timeout": timeout_s,
                "socket_connect_timeout": timeout_s,
                "password": parsed.sentinel_password,
            },
        )
        client = sentinel.master_for(
            parsed.service,
            redis_class=redis.Redis,
            db=parsed.db,
            username=parsed.username,
            password=parsed.password,
            ssl=parsed.ssl,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=retry(),
        )
        return RedisConnection(client, sentinel, parsed.service)
    try:
        client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry()
        )
        return RedisConnection(client)
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL {redact_url(url)!r}: {exc}") from None
