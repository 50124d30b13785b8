"""kvrouter on a real Redis Cluster (3 masters, 3 replicas, started by the fixture):
every index operation, partitions spread over masters, the routers' shared load, the
tracker election, a master failover reconciled, and an idle partition moved to another
master."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from bench.procs import RedisClusterNodes, sync_redis
from router.load import RedisLoadBoard, new_router_id
from tests.tracker.test_redis_index import NS, SEQ, batch, exercise, matches, remove, store
from tracker import keys as schema
from tracker.blocks import Namespace, block_keys
from tracker.errors import ConfigError
from tracker.lease import TrackerLease
from tracker.redis_client import ClusterURL, parse_cluster_url
from tracker.redis_index import RedisIndex

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
    models = [Namespace(f"model-{i}", NS.block_size) for i in range(8)]
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
    boards = [RedisLoadBoard(index.client, new_router_id()) for _ in range(2)]
    try:
        for board in boards:
            await board.start()
        boards[0].acquire(NS, "r1", 2048)
        deadline = time.monotonic() + 3
        while (await boards[1].snapshot(NS)).get("r1") is None:
            assert time.monotonic() < deadline, "the other router never saw the load"
            await asyncio.sleep(0.01)
        survey = await index.survey(NS, block_keys(SEQ, NS), load_except=boards[1].router_id)
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
        await index.apply("r1", NS, batch(store(SEQ)), 1)
        assert await index.restore_lost() == 0
        before = await index.server_id()
        with sync_redis(cluster_url) as client:
            owner = client.get_node_from_key(schema.NamespaceKeys(NS).seq).port
        replica = next(port for port in _ports(cluster) if _info(port).get("master_port") == owner)
        await _promote(replica)  # the partition's master moves to its replica
        # the client follows MOVED to the new master; the tracker sees a new set of masters
        await index.apply("r1", NS, batch(remove(SEQ, 3)), 2)
        assert await index.server_id() != before
        await index.restore_lost()  # reconciles whatever the promoted replica had not got
        assert await matches(index, SEQ) == {"r1": (3, 3)}
        assert await index.last_seq("r1", NS) == 2
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
        await index.apply("r1", NS, batch(store(SEQ)), 1)
        await index.apply("r2", NS, batch(store(SEQ[:8])), 7)
        before = await matches(index, SEQ)
        seq_key = schema.NamespaceKeys(NS).seq
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
        assert await index.last_seq("r1", NS) == 1 and await index.last_seq("r2", NS) == 7
        await index.apply("r1", NS, batch(remove(SEQ, 3)), 2)
        assert await matches(index, SEQ) == {**before, "r1": (3, 3)}
    finally:
        await index.close()


def _migrate_slot(slot: int, source: int, target: int, masters: list[int]) -> int:
    """Move ``slot`` from the master on port ``source`` to the one on ``target`` as
    ``redis-cli --cluster reshard`` does; the number of keys moved."""
    src, dst = redis.Redis(port=source), redis.Redis(port=target)
    try:
        src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        moved = 0
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
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
