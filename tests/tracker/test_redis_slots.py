"""RedisIndex on a one-node Redis Cluster: each operation works, each script stays in one slot."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator

import pytest
import redis

from tests.factories import LLAMA
from tests.procs import RedisServer, free_port
from tests.tracker.redis_ops import exercise
from tracker.core import keys as schema
from tracker.core import lua
from tracker.core.blocks import Namespace
from tracker.core.redis_index import RedisIndex

# ------------------------------------------------------------------ cluster safety


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes (its ``{...}`` tag, else the whole key)."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_KEYED = {"HGET", "HSET", "HDEL", "HMGET", "HGETALL", "GET", "SET", "INCR", "DECR"}
_KEYED |= {"SPOP", "SADD", "SREM", "SISMEMBER", "HEXISTS", "EXISTS", "DEL", "HINCRBY"}
_KEYED |= {"PTTL", "PEXPIRE", "PEXPIREAT", "HSETNX"}
_KEYED |= {"ZADD", "ZREM", "ZREMRANGEBYSCORE", "ZCOUNT", "ZSCORE"}
_KEYLESS = {"TIME"}


class Monitor:
    """Records which keys each script call declared and touched (Redis MONITOR)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(b"MONITOR\r\n")
        self.buffer = b""
        assert self._line() == "+OK"

    def _line(self) -> str:
        while b"\r\n" not in self.buffer:
            self.buffer += self.sock.recv(1 << 16)
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line.decode("latin-1")

    def calls(self, client: redis.Redis) -> list[tuple[str, list[str], set[str]]]:
        """(script sha, declared keys, touched keys) of every script run so far."""
        marker = f"monitor-end-{time.monotonic_ns()}"
        client.echo(marker)
        out: list[tuple[str, list[str], set[str]]] = []
        while True:
            line = self._line()
            if marker in line:
                self.sock.close()
                return out
            args = _ARG.findall(line)
            if "[0 lua]" in line:
                command = args[0].upper()
                assert command in _KEYED | _KEYLESS, f"unexpected script command {command}"
                if command in _KEYED:
                    out[-1][2].add(args[1])
            elif args and args[0].upper() in ("EVALSHA", "EVAL"):
                declared = args[3 : 3 + int(args[2])]
                out.append((args[1], declared, set(declared)))


@pytest.fixture(scope="module")
def cluster_server() -> Iterator[RedisServer]:
    """A one-node Redis Cluster owning every slot: cross-slot requests fail as on a cluster."""
    server = RedisServer(
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-port",
        str(free_port()),
    ).start()
    with redis.Redis.from_url(server.url) as client:
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 10
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "cluster did not come up"
            time.sleep(0.02)
    yield server
    server.close()


@pytest.fixture
def cluster_url(cluster_server: RedisServer) -> str:
    with redis.Redis.from_url(cluster_server.url) as client:
        client.flushall()
    return cluster_server.url


async def test_every_operation_works_on_redis_cluster(cluster_url: str) -> None:
    index = RedisIndex.from_url(cluster_url)
    try:
        await exercise(index)
    finally:
        await index.close()


async def test_each_script_call_stays_in_one_slot(
    cluster_server: RedisServer, cluster_url: str
) -> None:
    monitor = Monitor(cluster_server.port)
    index = RedisIndex.from_url(cluster_url)
    try:
        await exercise(index)
    finally:
        await index.close()
    with redis.Redis.from_url(cluster_url) as client:
        calls = monitor.calls(client)
        shas = {
            name: client.script_load(getattr(lua, name))
            for name in ("APPLY", "LOOKUP", "ROUTE", "RID", "RELEASE_RID", "HEARTBEAT", "REGISTRY")
        }
        assert {sha for sha, _, _ in calls} == set(shas.values())
        by_sha = {sha: name for name, sha in shas.items()}
        every_key = sorted(set().union(*(touched for _, _, touched in calls)))
        with client.pipeline(transaction=False) as pipe:
            for key in every_key:
                pipe.execute_command("CLUSTER", "KEYSLOT", key)
            slot_of = dict(zip(every_key, pipe.execute(), strict=True))
        for sha, declared, touched in calls:
            slots = {slot_of[key] for key in touched}
            assert len(slots) == 1, (by_sha[sha], touched)
            tags = {hash_tag(key) for key in touched | set(declared)}
            assert len(tags) == 1, (by_sha[sha], touched)
            if by_sha[sha] in ("APPLY", "LOOKUP", "ROUTE", "RID", "RELEASE_RID"):
                assert tags == {schema.nsid(LLAMA)}
            else:
                assert tags == {"replicas"}
        apply_keys = set().union(*(t for s, _, t in calls if by_sha[s] == "APPLY"))
        assert any(":b:" in key for key in apply_keys)
        assert any(":e:" in key for key in apply_keys)


@pytest.mark.parametrize(
    ("key", "tag"),
    [("a{b}c", "b"), ("a{}c{d}", "a{}c{d}"), ("{x}{y}", "x"), ("plain", "plain"), ("a{b", "a{b")],
)
def test_hash_tag_rule(key: str, tag: str) -> None:
    assert hash_tag(key) == tag


def test_schema_keys_of_a_namespace_share_its_tag() -> None:
    nk = schema.NamespaceKeys(LLAMA)
    names = [nk.rid, nk.rname, nk.ridseq, nk.ridfree, nk.seq, nk.load]
    names += [nk.block_bucket(0), nk.block_bucket((1 << 64) - 1), nk.prediction_bucket(5)]
    names += [*nk.engine_buckets(16383)[:3], nk.engine_bucket(7, (1 << 64) - 1)]
    assert {hash_tag(n) for n in names} == {schema.nsid(LLAMA)}
    assert hash_tag(schema.REPLICAS) == hash_tag(schema.REPLICAS_SEEN)
    assert schema.NamespaceKeys(Namespace("llama", 4, "lora")).tag == nk.tag
    assert schema.NamespaceKeys(Namespace("llama", 8)).tag != nk.tag
