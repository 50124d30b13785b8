"""RedisIndex specifics: restart restore, outages, cluster safety, rid reuse, memory."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import socket
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis

from tests.factories import LLAMA, batch
from tests.procs import RedisServer, free_port
from tracker.core import keys as schema
from tracker.core import lua
from tracker.core.blocks import Namespace, block_keys
from tracker.core.events import BlockRemoved, BlockStored
from tracker.core.index import ReplicaRecord
from tracker.core.redis_index import RedisIndex
from tracker.core.redis_writes import OPS_PER_CALL
from tracker.framework.errors import ConfigError, IndexUnavailableError

SEQ = list(range(1000, 1016))  # 4 blocks
OTHER = list(range(2000, 2016))


def engine_hashes(tokens: list[int]) -> list[int]:
    """Stand-ins for vLLM's chained block hashes (another chain than the index keys)."""
    return block_keys(tokens, Namespace("engine", LLAMA.block_size))


def engine_hash(tokens: list[int], block: int) -> int:
    return engine_hashes(tokens[: (block + 1) * LLAMA.block_size])[block]


def store(tokens: list[int], blocks: range | None = None) -> BlockStored:
    blocks = blocks if blocks is not None else range(len(tokens) // LLAMA.block_size)
    hashes = engine_hashes(tokens[: blocks.stop * LLAMA.block_size])
    parent = hashes[blocks.start - 1] if blocks.start else None
    return BlockStored(
        hashes[blocks.start : blocks.stop],
        parent,
        tokens[blocks.start * LLAMA.block_size : blocks.stop * LLAMA.block_size],
        LLAMA.block_size,
        medium="GPU",
    )


def offload(tokens: list[int], *blocks: int) -> BlockStored:
    return BlockStored([engine_hash(tokens, b) for b in blocks], None, [], 0, medium="CPU")


def remove(tokens: list[int], *blocks: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved([engine_hash(tokens, b) for b in blocks], medium)


async def matches(index: RedisIndex, tokens: list[int]) -> dict[str, tuple[int, int]]:
    found = await index.lookup(LLAMA, block_keys(tokens, LLAMA))
    return {r: (m.blocks, m.gpu_blocks) for r, m in found.items()}


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A redis-server this test may stop, pause and restart (not the shared session one)."""
    server = RedisServer().start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)
    server.close()


@pytest.fixture
async def index_factory(redis_url: str) -> AsyncIterator[Callable[..., RedisIndex]]:
    made: list[RedisIndex] = []

    def make(url: str = redis_url, **kwargs: Any) -> RedisIndex:
        made.append(RedisIndex.from_url(url, **kwargs))
        return made[-1]

    yield make
    for index in made:
        await index.close()


# ------------------------------------------------------------------ layout


async def test_bucket_entries_hold_each_replicas_rid_and_tiers(
    index_factory: Any, redis_url: str
) -> None:
    """A block bucket's value is ``rid << 4 | tiers`` per replica (layout v2, the partition's
    key prefix says so), as ``tracker.core.keys.bucket_entries`` reads it; a restored engine map
    keeps every tier's references."""
    index = index_factory()
    await index.apply("r1", LLAMA, batch(store(SEQ), offload(SEQ, 0)), 1)
    await index.apply("r2", LLAMA, batch(store(SEQ)), 1)
    await index.apply("r2", LLAMA, batch(remove(SEQ, 0)), 2)
    nk = schema.NamespaceKeys(LLAMA)
    assert nk.block_prefix.startswith(f"{schema.PARTITION_PREFIX}:{{")
    first = block_keys(SEQ, LLAMA)[0]
    with redis.Redis.from_url(redis_url) as client:
        value = client.hget(nk.block_bucket(first), schema.field(first))
    rids = {await index.rid(r, LLAMA): r for r in ("r1", "r2")}
    assert {rids[rid]: tiers for rid, tiers in schema.bucket_entries(value)} == {"r1": 0b11}
    rid1 = await index.rid("r1", LLAMA)
    with redis.Redis.from_url(redis_url) as client:  # a value of another layout (12 bytes)
        client.hset(nk.engine_bucket(rid1, 7), schema.field(7), bytes(12))
    restarted = index_factory()
    await restarted.apply("r1", LLAMA, batch(remove(SEQ, 0)), 2)  # its ledger restored first
    assert await matches(restarted, SEQ) == {"r1": (4, 3)}  # r2 lost block 0: no run
    assert await restarted.block_count("r1", LLAMA) == 4  # the foreign entry was skipped


# ------------------------------------------------------------------ tracker restart


async def test_restart_restores_ledger_from_engine_map(index_factory: Any) -> None:
    first = index_factory()
    await first.apply("r1", LLAMA, batch(store(SEQ), store(SEQ, range(2))), 7)  # blocks 0-1 twice
    await first.apply("r1", LLAMA, batch(offload(SEQ, 3)), 8)
    await first.apply("r2", LLAMA, batch(store(OTHER)), 3)
    await first.close()

    second = index_factory()
    assert await second.block_count("r1", LLAMA) == 4
    assert await second.last_seq("r1", LLAMA) == 8
    assert await matches(second, SEQ) == {"r1": (4, 4)}
    # Ref counts survived the restart: blocks 0-1 need two removals each.
    await second.apply("r1", LLAMA, batch(remove(SEQ, 0, 3)), 9)
    assert await matches(second, SEQ) == {"r1": (4, 3)}
    await second.apply("r1", LLAMA, batch(remove(SEQ, 0)), 10)
    assert await matches(second, SEQ) == {}
    await second.apply("r1", LLAMA, batch(remove(SEQ, 3, medium="CPU")), 11)
    assert await second.block_count("r1", LLAMA) == 2  # blocks 1 and 2
    # New blocks chain onto restored ones.
    await second.apply("r2", LLAMA, batch(remove(OTHER, 3), store(OTHER, range(3, 4))), 4)
    assert await matches(second, OTHER) == {"r2": (4, 4)}
    third = index_factory()
    assert await third.block_count("r1", LLAMA) == 2
    assert await third.block_count("r2", LLAMA) == 4
    assert await third.last_seq("r1", LLAMA) == 11


async def test_restart_after_clear_and_forget_restores_nothing(index_factory: Any) -> None:
    first = index_factory()
    await first.apply("r1", LLAMA, batch(store(SEQ)), 1)
    await first.apply("r2", LLAMA, batch(store(SEQ)), 1)
    await first.clear("r1", LLAMA)
    await first.forget("r2", LLAMA)
    second = index_factory()
    assert await second.block_count("r1", LLAMA) == 0
    assert await second.block_count("r2", LLAMA) == 0
    assert await second.last_seq("r1", LLAMA) is None
    assert await matches(second, SEQ) == {}


# ------------------------------------------------------------------ outages


async def test_pending_writes_survive_a_paused_redis(own_server: RedisServer) -> None:
    index = RedisIndex.from_url(own_server.url, timeout_s=0.3)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ, range(2)), store(OTHER, range(1))), 1)
        assert own_server.proc is not None
        os.kill(own_server.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(IndexUnavailableError):
                await index.apply("r1", LLAMA, batch(store(SEQ, range(2, 4))), 2)
            with pytest.raises(IndexUnavailableError):
                await index.apply("r1", LLAMA, batch(store(OTHER, range(1, 4))), 3)
            with pytest.raises(IndexUnavailableError):
                await index.apply("r1", LLAMA, batch(remove(OTHER, 3)), 4)
            assert await index.last_seq("r1", LLAMA) == 4  # answered from the pending write
            assert await index.flush() == 1
        finally:
            os.kill(own_server.proc.pid, signal.SIGCONT)
        # Requests that timed out during the pause are still queued in the server; let them
        # run before checking, they carry older (idempotent) states of the same pending write.
        await asyncio.sleep(0.3)
        assert await index.flush() == 0
        assert await index.flush() == 0
        fresh = RedisIndex.from_url(own_server.url)
        try:
            assert await matches(fresh, SEQ) == {"r1": (4, 4)}
            assert await matches(fresh, OTHER) == {"r1": (3, 3)}
            assert await fresh.last_seq("r1", LLAMA) == 4
            assert await fresh.block_count("r1", LLAMA) == 7
        finally:
            await fresh.close()
    finally:
        await index.close()


async def test_redis_restarted_empty_gets_the_whole_state_back(own_server: RedisServer) -> None:
    index = RedisIndex.from_url(own_server.url, timeout_s=0.5)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ, range(2))), 1)
        await index.apply("r2", LLAMA, batch(store(OTHER)), 1)
        own_server.stop()
        with pytest.raises(IndexUnavailableError):
            await index.apply("r1", LLAMA, batch(store(SEQ, range(2, 4))), 2)
        assert await index.flush() == 1
        own_server.start()  # same port, no data
        assert await index.flush() == 0
        # r1 had a pending write: Redis lost its id, so its whole state was written again.
        assert await matches(index, SEQ) == {"r1": (4, 4)}
        assert await index.last_seq("r1", LLAMA) == 2
        # r2 was idle: nothing wrote it back yet; the tracker's periodic check does.
        assert await matches(index, OTHER) == {}
        assert await index.restore_lost() == 1
        assert await matches(index, OTHER) == {"r2": (4, 4)}
        assert await index.last_seq("r2", LLAMA) == 1
        assert await index.restore_lost() == 0  # nothing lost any more
        await index.apply("r2", LLAMA, batch(), 2)
        assert await matches(index, OTHER) == {"r2": (4, 4)}
        restarted = RedisIndex.from_url(own_server.url)
        try:
            assert await restarted.block_count("r1", LLAMA) == 4
            assert await restarted.block_count("r2", LLAMA) == 4
        finally:
            await restarted.close()
    finally:
        await index.close()


async def test_rid_taken_after_data_loss_is_reallocated(own_server: RedisServer) -> None:
    index = RedisIndex.from_url(own_server.url, timeout_s=0.5)
    other = RedisIndex.from_url(own_server.url, timeout_s=0.5)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        old_rid = await index.rid("r1", LLAMA)
        own_server.stop()
        own_server.start()
        # Another tracker registers a new replica first and is handed r1's old id.
        await other.apply("r3", LLAMA, batch(store(OTHER)), 1)
        assert await other.rid("r3", LLAMA) == old_rid
        await index.apply("r1", LLAMA, batch(store(SEQ, range(1))), 2)
        assert await index.rid("r1", LLAMA) != old_rid
        assert await matches(index, SEQ) == {"r1": (4, 4)}
        assert await matches(index, OTHER) == {"r3": (4, 4)}
        assert await index.last_seq("r1", LLAMA) == 2
    finally:
        await index.close()
        await other.close()


async def test_unreachable_redis_raises_index_unavailable() -> None:
    index = RedisIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3)
    try:
        with pytest.raises(IndexUnavailableError):
            await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        with pytest.raises(IndexUnavailableError):
            await index.lookup(LLAMA, block_keys(SEQ, LLAMA))
        with pytest.raises(IndexUnavailableError):
            await index.register(ReplicaRecord(id="r1", model="llama", block_size=4))
        with pytest.raises(IndexUnavailableError):
            await index.replicas()
        with pytest.raises(IndexUnavailableError):
            await index.deregister("r1")
        assert not await index.ping()
        assert await index.flush() == 0
    finally:
        await index.close()


async def test_failed_multi_call_write_leaks_no_connection(own_server: RedisServer) -> None:
    index = RedisIndex.from_url(own_server.url, timeout_s=0.5)
    tokens = list(range(4 * (OPS_PER_CALL + 10)))
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        own_server.stop()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with pytest.raises(IndexUnavailableError):
                    await index.apply("r1", LLAMA, batch(store(tokens)), 2)
            gc.collect()
        assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        own_server.start()
        assert await index.flush() == 0
        found = await index.lookup(LLAMA, block_keys(tokens, LLAMA))
        assert found["r1"].blocks == OPS_PER_CALL + 10
    finally:
        await index.close()


def test_bad_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Redis URL"):
        RedisIndex.from_url("http://127.0.0.1:6379")


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
_KEYED |= {"PTTL", "PEXPIRE"}
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


async def exercise(index: RedisIndex) -> None:
    """Every index operation, including multi-call writes and a restore."""
    big = list(range(4 * (OPS_PER_CALL + 1)))
    await index.apply("r1", LLAMA, batch(store(SEQ), offload(SEQ, 0)), 1)
    await index.apply("r2", LLAMA, batch(store(big)), 1)
    await index.apply("r1", LLAMA, batch(remove(SEQ, 3)), 2)
    assert await matches(index, SEQ) == {"r1": (3, 3)}
    assert (await index.lookup(LLAMA, block_keys(big, LLAMA)))["r2"].blocks == OPS_PER_CALL + 1
    assert await index.last_seq("r1", LLAMA) == 2
    await index.register(ReplicaRecord(id="r1", model="llama", block_size=4, ttl_s=0.01))
    assert [r.id for r in await index.replicas()] == ["r1"]
    await asyncio.sleep(0.05)
    assert [r.id for r in await index.reap()] == ["r1"]
    await index.register(ReplicaRecord(id="r2", model="llama", block_size=4))
    await index.deregister("r2")
    await index.clear("r2", LLAMA)
    await index.forget("r1", LLAMA)
    await index.apply("r3", LLAMA, batch(store(OTHER)), 1)
    restored = RedisIndex(index.client)
    assert await restored.block_count("r3", LLAMA) == 4


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
            for name in ("APPLY", "LOOKUP", "RID", "RELEASE_RID", "HEARTBEAT", "REGISTRY")
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
            if by_sha[sha] in ("APPLY", "LOOKUP", "RID", "RELEASE_RID"):
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


async def test_claims_sweep_expired_homes_from_a_bucket_kept_alive(
    index_factory: Any, redis_url: str
) -> None:
    """A bucket written without pause never expires: claims drop its expired records."""
    index = index_factory()
    nk = schema.NamespaceKeys(LLAMA)
    stale = [(9 << 50) | i for i in range(1, 6)]
    await index.claim(LLAMA, "a", stale, ttl_s=0.2)
    bucket = nk.home_bucket(stale[0])
    assert {nk.home_bucket(k) for k in stale} == {bucket}
    await index.claim(LLAMA, "b", [(9 << 50) | 99], ttl_s=5)
    assert await index.client.hlen(bucket) == 6
    await asyncio.sleep(0.3)
    await index.claim(LLAMA, "b", [(9 << 50) | 99], ttl_s=5)
    assert await index.client.hlen(bucket) == 1
    assert await index.client.pttl(bucket) > 1000


# ------------------------------------------------------------------ replica ids


async def test_rid_is_reused_after_forget(index_factory: Any, redis_url: str) -> None:
    index = index_factory()
    await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
    await index.apply("r2", LLAMA, batch(store(OTHER)), 1)
    rid1 = await index.rid("r1", LLAMA)
    assert await index.forget("r1", LLAMA) == 4
    assert await matches(index, SEQ) == {}
    assert await index.last_seq("r1", LLAMA) is None
    await index.apply("r3", LLAMA, batch(store(SEQ, range(2))), 1)
    assert await index.rid("r3", LLAMA) == rid1
    assert await matches(index, SEQ) == {"r3": (2, 2)}
    assert await matches(index, OTHER) == {"r2": (4, 4)}
    # The departed replica comes back under a new id, with an empty ledger.
    await index.apply("r1", LLAMA, batch(store(SEQ, range(1))), 5)
    assert await index.rid("r1", LLAMA) not in (rid1, await index.rid("r2", LLAMA))
    assert await matches(index, SEQ) == {"r3": (2, 2), "r1": (1, 1)}
    # A restarted tracker restores exactly what each id holds now.
    restarted = index_factory()
    assert await restarted.block_count("r3", LLAMA) == 2
    assert await restarted.block_count("r1", LLAMA) == 1
    assert await restarted.block_count("r2", LLAMA) == 4


async def test_predictions_never_land_on_the_new_owner_of_a_reused_rid(
    index_factory: Any,
) -> None:
    tracker, router = index_factory(), index_factory()
    await tracker.apply("r1", LLAMA, batch(store(SEQ, range(1))), 1)
    stale = await router.rid("r1", LLAMA)  # the router caches r1's rid
    await tracker.forget("r1", LLAMA)
    await tracker.apply("r2", LLAMA, batch(store(OTHER)), 1)
    assert await tracker.rid("r2", LLAMA) == stale  # r2 now owns r1's old rid
    await router.predict(LLAMA, "r1", block_keys(SEQ, LLAMA), ttl_s=5)
    found = await router.lookup(LLAMA, block_keys(SEQ, LLAMA))
    assert {r: m.predicted_blocks for r, m in found.items()} == {"r1": 4}


async def test_rids_are_per_namespace(index_factory: Any) -> None:
    index = index_factory()
    other = Namespace("mistral", 4)
    assert await index.rid("a", LLAMA) == 1
    assert await index.rid("b", LLAMA) == 2
    assert await index.rid("b", other) == 1
    assert await index.rid("a", LLAMA) == 1
    assert await index_factory().rid("b", LLAMA) == 2


# ------------------------------------------------------------------ memory


async def _used_memory(client: redis.asyncio.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def test_memory_per_block_and_replica(index_factory: Any, redis_url: str) -> None:
    """Sanity bound, not a benchmark: bench/index_bench.py measures the real figure."""
    blocks = 10_000
    tokens = [(i * 7919) % 50_000 for i in range(blocks * LLAMA.block_size)]
    index = index_factory()
    hashes = list(range(1 << 40, (1 << 40) + blocks))
    event = BlockStored(hashes, None, tokens, LLAMA.block_size, medium="GPU")
    await index.apply("warm-up", LLAMA, batch(store(SEQ)), 0)
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        before = await _used_memory(client)
        await index.apply("r0", LLAMA, batch(event), 1)
        first = (await _used_memory(client) - before) / blocks
        for r in range(1, 4):
            await index.apply(f"r{r}", LLAMA, batch(event), 1)
        per_pair = (await _used_memory(client) - before) / (4 * blocks)
    finally:
        await client.aclose()
    found = await index.lookup(LLAMA, block_keys(tokens, LLAMA))
    assert {r: m.blocks for r, m in found.items()} == {f"r{r}": blocks for r in range(4)}
    # A fleet shares its blocks: amortized over 4 replicas a (block, replica) costs < 100 B.
    assert per_pair < 100, per_pair
    # A lone replica with few blocks pays for sparse buckets: ~one Redis hash key per block
    # below ~10^5 blocks per namespace (2**16 buckets), hence the looser bound.
    assert first < 250, first
