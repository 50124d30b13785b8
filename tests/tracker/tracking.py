"""Shared by the subscriber tests: a chain of blocks, settings, waiting, a Tracker to drive."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from tests.factories import SMALL, stored
from tests.tracker.publisher import EventPublisher
from tracker.core.blocks import Namespace, block_keys
from tracker.core.index import BlockIndex
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics
from tracker.ingest.streams import ReplicaStream, ReplicaTarget
from tracker.ingest.subscriber import Subscriber

ANY = "tcp://127.0.0.1:*"

# A chain: A = two blocks, B extends A, C extends B; D, E, F are unrelated roots.
A_TOKENS, A_HASHES = list(range(1, 9)), [101, 102]
B_TOKENS, B_HASH = list(range(9, 13)), 103
C_TOKENS, C_HASH = list(range(13, 17)), 104
ROOTS = {name: ([n * 100 + i for i in range(4)], 1000 + n) for n, name in enumerate("DEFG", 1)}


def block_a() -> Any:
    return stored(A_TOKENS, A_HASHES)


def block_b() -> Any:
    return stored(B_TOKENS, [B_HASH], parent=A_HASHES[-1])


def block_c() -> Any:
    return stored(C_TOKENS, [C_HASH], parent=B_HASH)


def root(name: str) -> Any:
    tokens, h = ROOTS[name]
    return stored(tokens, [h])


def settings(**overrides: Any) -> TrackerSettings:
    values: dict[str, Any] = {
        "model": SMALL.model,
        "block_size": SMALL.block_size,
        "http_port": 0,
        "replay_timeout_s": 0.5,
        "resync_cooldown_s": 0.2,
    }
    values.update(overrides)
    return TrackerSettings(**values)


async def wait_until(predicate: Callable[[], Any], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll ``predicate`` (plain or awaitable result) until truthy; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)


async def held(
    index: BlockIndex, tokens: list[int], namespace: Namespace = SMALL
) -> dict[str, int]:
    matches = await index.lookup(namespace, block_keys(tokens, namespace))
    return {replica: match.blocks for replica, match in matches.items()}


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


class Tracker:
    """A subscriber with its index and metrics, as a test drives it."""

    def __init__(self, index: BlockIndex, config: TrackerSettings) -> None:
        self.index = index
        self.registry = CollectorRegistry()
        self.metrics = TrackerMetrics(self.registry)
        self.subscriber = Subscriber(config, index, self.metrics)

    async def track(self, replica: str, publisher: EventPublisher) -> ReplicaStream:
        stream = self.subscriber.track(
            ReplicaTarget(replica, SMALL, publisher.endpoint, publisher.replay_endpoint)
        )
        await wait_until(lambda: stream.primed, what="stream primed")
        await publisher.wait_subscribed()
        return stream

    def value(self, name: str, **labels: str) -> float:
        return sample(self.registry, name, **labels)


TrackerFactory = Callable[..., Awaitable[Tracker]]
