"""kvrouter on a real Redis Cluster (3 masters, 3 replicas, started by the fixture):
every index operation, partitions spread over masters, the routers' shared load, the
tracker election, a master failover reconciled, and a partition moved to another master,
idle and under load."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from bench.stack.redis_servers import RedisClusterNodes, sync_redis
from router.shared.redis_load import RedisLoadBoard, new_router_id
from tests.factories import LLAMA, batch
from tests.tracker.redis_ops import SEQ, exercise, matches, remove, store
from tracker.core import keys as schema
from tracker.core.blocks import Namespace, block_keys
from tracker.core.index import Route
from tracker.core.redis_client import ClusterURL, parse_cluster_url
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import ConfigError, IndexUnavailableError
from tracker.ingest.lease import TrackerLease

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    nodes = RedisClusterNodes(masters=3, replicas=1).start()
    try:
        yield nodes
    finally:
        nodes.close()


@pytest.fixture
def cluster_url(cluster: RedisClusterNodes) -> str:
    with sync_redis(cluster.url) as client:
        client.flushall(target_nodes=client.PRIMARIES)
    return cluster.url


def test_cluster_urls_parse_and_bad_ones_are_config_errors() -> None:
    assert parse_cluster_url("redis+cluster://:pw@h1:7000,h2") == ClusterURL(
        (("h1", 7000), ("h2", 6379)), password="pw"
    )
    assert parse_cluster_url("rediss+cluster://u:p@h:1").ssl
    for bad in ("redis+cluster://h1/0", "redis+cluster://h1?x=1", "redis+cluster://", "redis://h"):
        with pytest.raises(ConfigError):
            parse_cluster_url(bad)


async def test_every_index_operation_works_on_a_real_cluster(cluster_url: str) -> None:
    index = RedisIndex.from_url(cluster_url)
    try:
        await exercise(index)
    finally:
        await index.close()


async def test_partitions_of_different_models_live_on_different_masters(
    cluster_url: str,
) -> None:
    models = [Namespace(f"model-{i}", LLAMA.block_size) for i in range(8)]
    index = RedisIndex.from_url(cluster_url)
    try:
        for rid, namespace in enumerate(models):
            await index.apply(f"r{rid}", namespace, batch(store(SEQ)), 1)
        owners = set()
        with sync_redis(cluster_url) as client:
            for namespace in models:
                seq_key = schema.NamespaceKeys(namespace).seq
                owners.add(client.get_node_from_key(seq_key).name)
        assert len(owners) >= 2, owners  # 8 partitions, 3 masters
        for rid, namespace in enumerate(models):
            found = await index.lookup(namespace, block_keys(SEQ, namespace))
            assert {r: m.blocks for r, m in found.items()} == {f"r{rid}": 4}
        memory = await index.memory()  # the masters' sum
        assert memory.used_bytes > 0 and memory.policy == "noeviction"
    finally:
        await index.close()


async def test_router_load_and_the_tracker_election_work_on_a_cluster(cluster_url: str) -> None:
    index = RedisIndex.from_url(cluster_url)
    boards = [
        RedisLoadBoard(index.client, new_router_id(), lease_ttl_s=5.0, renew_interval_s=1.0)
        for _ in range(2)
    ]
    try:
        for board in boards:
            await board.start()
        boards[0].acquire(LLAMA, "r1", 2048)
        deadline = time.monotonic() + 3
        while (await boards[1].snapshot(LLAMA)).get("r1") is None:
            assert time.monotonic() < deadline, "the other router never saw the load"
            await asyncio.sleep(0.01)
        survey = await index.survey(LLAMA, block_keys(SEQ, LLAMA), load_except=boards[1].router_id)
        assert survey.load is not None and survey.load["r1"][:2] == (1, 2048)
        first = TrackerLease(index.client, "fleet", 5.0, holder="a")
        second = TrackerLease(index.client, "fleet", 5.0, holder="b")
        assert (await first.acquire(), await second.acquire()) == (1, 0)
        assert await index.claim_partitions(first.fence, "fleet") == 0
    finally:
        for board in boards:
            await board.stop()
        await index.close()


async def test_a_master_failover_is_followed_and_reconciled(
    cluster: RedisClusterNodes, cluster_url: str
) -> None:
    index = RedisIndex.from_url(cluster_url)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        assert await index.restore_lost() == 0
        before = await index.recovery.server_id()
        with sync_redis(cluster_url) as client:
            owner = client.get_node_from_key(schema.NamespaceKeys(LLAMA).seq).port
        replica = next(port for port in _ports(cluster) if _info(port).get("master_port") == owner)
        await _promote(replica)  # the partition's master moves to its replica
        # the client follows MOVED to the new master; the tracker sees a new set of masters
        await index.apply("r1", LLAMA, batch(remove(SEQ, 3)), 2)
        assert await index.recovery.server_id() != before
        await index.restore_lost()  # reconciles whatever the promoted replica had not got
        assert await matches(index, SEQ) == {"r1": (3, 3)}
        assert await index.last_seq("r1", LLAMA) == 2
    finally:
        await index.close()


async def test_an_idle_partition_moved_to_another_master_keeps_everything(
    cluster: RedisClusterNodes, cluster_url: str
) -> None:
    """The documented safe way to reshard (docs/deployment.md): move a partition's slot
    while nothing writes to it, with the commands ``redis-cli --cluster reshard`` issues
    (IMPORTING / MIGRATING, ``MIGRATE`` of every key, ``SETSLOT NODE``). Every placement and
    checkpoint arrives; the clients follow ``MOVED`` to the new master and go on writing
    there."""
    index = RedisIndex.from_url(cluster_url)
    try:
        await index.apply("r1", LLAMA, batch(store(SEQ)), 1)
        await index.apply("r2", LLAMA, batch(store(SEQ[:8])), 7)
        before = await matches(index, SEQ)
        seq_key = schema.NamespaceKeys(LLAMA).seq
        with sync_redis(cluster_url) as client:
            slot = client.keyslot(seq_key)
            source = client.get_node_from_key(seq_key).port
        masters = [port for port in _ports(cluster) if _info(port).get("role") == "master"]
        target = next(port for port in masters if port != source)
        moved = await asyncio.to_thread(_migrate_slot, slot, source, target, masters)
        assert moved > 0
        with sync_redis(cluster_url) as client:
            assert client.get_node_from_key(seq_key).port == target
        # the same client: its slot map is stale until the first MOVED
        assert await matches(index, SEQ) == before
        assert await index.last_seq("r1", LLAMA) == 1 and await index.last_seq("r2", LLAMA) == 7
        await index.apply("r1", LLAMA, batch(remove(SEQ, 3)), 2)
        assert await matches(index, SEQ) == {**before, "r1": (3, 3)}
    finally:
        await index.close()


async def test_a_live_partition_moved_to_another_master_under_load_loses_nothing(
    cluster: RedisClusterNodes, cluster_url: str
) -> None:
    """Resharding while a tracker writes and a router reads and writes the partition.

    ``redis-cli --cluster reshard`` moves a slot's keys in whatever order Redis lists them.
    Here the six keys ``APPLY`` names move first: Redis then sends the call on to the
    importing master (``ASK``), where the buckets have not arrived yet. Had the call named
    only those six, it would run there against empty buckets: the removal of chain 0 would
    find nothing to remove, and chain 0 would come back with its bucket. Every key a writing
    script touches is named, so Redis refuses the whole call (``TRYAGAIN``) while any of them
    is on the other side; the tracker's index keeps the refused changes and writes them after
    the move. The router's lookups and routing writes are refused meanwhile, which a router
    counts as load-only fallbacks: nothing raises but :class:`IndexUnavailableError`, the
    migration never meets a key written behind it (``BUSYKEY``), and at the end the index
    holds exactly what the events say."""
    index = RedisIndex.from_url(cluster_url)
    chains = [[10_000 * c + t for t in range(16)] for c in range(400)]
    try:
        for c, chain in enumerate(chains[:60]):  # a partition with a few hundred keys
            await index.apply("r1", LLAMA, batch(store(chain)), c + 1)
        await index.apply("gone", LLAMA, batch(store(chains[-1])), 1)
        await index.forget("gone", LLAMA)  # a released rid: the free-rid set exists
        await index.claim_partitions(1, "0")  # an elected tracker writes: the fence exists
        nk = schema.NamespaceKeys(LLAMA)
        named = [nk.seq, nk.rid, nk.rname, nk.ridseq, nk.ridfree, nk.fence("0")]
        # ... and the bucket of chain 0's first block, which the first call evicts
        first = [*named, nk.block_bucket(block_keys(chains[0], LLAMA)[0])]
        with sync_redis(cluster_url) as client:
            slot = client.keyslot(nk.seq)
            source = client.get_node_from_key(nk.seq).port
        masters = [port for port in _ports(cluster) if _info(port).get("role") == "master"]
        target = next(port for port in masters if port != source)
        half_moved = threading.Event()
        migration = asyncio.create_task(
            asyncio.to_thread(
                _migrate_slot, slot, source, target, masters,
                first=first, moved_first=half_moved, per_call=2, pause=0.01,
            )
        )  # fmt: skip
        assert await asyncio.to_thread(half_moved.wait, 10)
        refused = {"apply": 0, "lookup": 0, "route": 0}
        c, after = 60, 0
        while after < 3:  # until the migration has ended, and a few requests past it
            after += migration.done()
            evict_oldest_store_newest = batch(remove(chains[c - 60], *range(4)), store(chains[c]))
            try:
                await index.apply("r1", LLAMA, evict_oldest_store_newest, c + 1)
            except IndexUnavailableError:
                refused["apply"] += 1
            c += 1
            assert c < len(chains), "the migration outlasted the workload"
            keys = block_keys(chains[c - 2], LLAMA)
            try:
                await index.lookup(LLAMA, keys)
            except IndexUnavailableError:
                refused["lookup"] += 1
            try:  # predictions for another replica, so that r1's own blocks are what is read
                await index.route(LLAMA, Route("r2", keys, 5, keys[:1], 5))
            except IndexUnavailableError:
                refused["route"] += 1
        moved = await migration  # no BUSYKEY: nothing was written behind the migration
        assert moved > 100
        with sync_redis(cluster_url) as client:
            assert client.get_node_from_key(nk.seq).port == target
        assert refused["apply"] > 0, "the workload never met the migration"
        await index.apply("r1", LLAMA, batch(), c)  # writes whatever Redis refused meanwhile
        for i, chain in enumerate(chains[:c]):
            held = (await matches(index, chain)).get("r1")
            assert held == ((4, 4) if i >= c - 60 else None), (i, c, refused)
        assert await index.last_seq("r1", LLAMA) == c
        # no call ran halfway: the held-blocks count APPLY keeps is the ledger's
        residency = (await index.survey(LLAMA, [])).residency["r1"]
        assert residency.blocks == await index.block_count("r1", LLAMA) == 4 * 60
    finally:
        await index.close()


def _migrate_slot(
    slot: int,
    source: int,
    target: int,
    masters: list[int],
    *,
    first: list[str] | None = None,
    moved_first: threading.Event | None = None,
    per_call: int = 100,
    pause: float = 0.0,
) -> int:
    """Move ``slot`` from the master on port ``source`` to the one on ``target`` as
    ``redis-cli --cluster reshard`` does (``first`` these keys, then ``moved_first`` is set,
    then ``per_call`` keys per ``MIGRATE``, ``pause`` seconds between them); the number of
    keys moved."""
    src, dst = redis.Redis(port=source), redis.Redis(port=target)
    try:
        src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        if first:
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *first)
            moved += len(first)
        if moved_first is not None:
            moved_first.set()
            time.sleep(pause * 20)  # the half-moved state, long enough to meet some calls
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, per_call):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            time.sleep(pause)
        for port in masters:  # every master learns the new owner (the target first)
            with redis.Redis(port=port) as node:
                node.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        return moved
    finally:
        src.close()
        dst.close()


def _ports(cluster: RedisClusterNodes) -> list[int]:
    return [node.port for node in cluster.nodes]


def _info(port: int) -> dict[str, object]:
    with redis.Redis(port=port, socket_timeout=2.0) as client:
        info: dict[str, object] = client.info("replication")
        return info


async def _promote(replica: int, attempts: int = 4) -> None:
    """A manual ``CLUSTER FAILOVER`` (no write lost), asked again if it did not happen: it
    waits for the replica to catch up and the masters to agree, which a busy host can make
    miss its window."""
    deadline = time.monotonic() + 10
    while _info(replica).get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never linked to its master"
        await asyncio.sleep(0.05)
    for _ in range(attempts):
        with redis.Redis(port=replica) as promoted:
            promoted.execute_command("CLUSTER", "FAILOVER")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if _info(replica)["role"] == "master":
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"the replica on port {replica} was not promoted")
