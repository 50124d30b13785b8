"""The router benchmark's fixture: routers built from their own objects (:class:`Bench`) over a
populated index, Redis or embedded, and the conversations of a target size fed to them."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec
from prometheus_client import CollectorRegistry

from bench.corpus import Lexicon
from router.config import RouterSettings
from router.decide.decider import Decider
from router.decide.placement import Placement
from router.decide.request import PromptRequest, parse
from router.decide.tokenize import TokenizerBook
from router.router import Router
from router.shared.redis_load import RedisLoadBoard
from tracker.core.backends import open_index
from tracker.core.blocks import Namespace
from tracker.core.events import BlockStored, EventBatch, ExternalHash
from tracker.core.index import BlockIndex
from tracker.core.redis_index import RedisIndex

MODEL: Final = "bench-model"
BLOCK_SIZE: Final = 16
REPLICAS: Final = 8
QUESTION_TOKENS: Final = 100
EVENT_BLOCKS: Final = 512  # blocks per BlockStored: one 8k-token chunked-prefill step
Messages = list[dict[str, str]]


@dataclass
class Workload:
    """Conversations of a target size in tokens, drawn from a lexicon."""

    lexicon: Lexicon
    chars_per_token: float

    def conversation(self, rng: random.Random, prefix_tokens: int) -> Messages:
        """A system prompt (a quarter, at most 4k tokens) and user/assistant turns of <= 2k."""
        system = min(prefix_tokens // 4, 4_000)
        turns = max(2, 2 * math.ceil((prefix_tokens - system) / 4_000))
        per_turn = (prefix_tokens - system) // turns
        messages = [{"role": "system", "content": self._text(rng, system)}]
        for turn in range(turns):
            role = "user" if turn % 2 == 0 else "assistant"
            messages.append({"role": role, "content": self._text(rng, per_turn)})
        return messages

    def question(self, rng: random.Random) -> dict[str, str]:
        chars = round(QUESTION_TOKENS * self.chars_per_token)
        return {"role": "user", "content": self.lexicon.question(rng, chars)}

    def _text(self, rng: random.Random, tokens: int) -> str:
        return self.lexicon.text(rng, round(tokens * self.chars_per_token))


def chat_request(messages: Messages) -> PromptRequest:
    """The request the router would parse from a client's body."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 16}
    return parse(msgspec.json.encode(body), "chat")


async def store(index: BlockIndex, replica: str, tokens: Sequence[int], rng: random.Random) -> None:
    """Index ``tokens``' full blocks on ``replica`` as its engine's prefill events would."""
    namespace = Namespace(MODEL, BLOCK_SIZE)
    parent: ExternalHash | None = None
    whole = len(tokens) // BLOCK_SIZE
    for start in range(0, whole, EVENT_BLOCKS):
        count = min(EVENT_BLOCKS, whole - start)
        hashes: list[ExternalHash] = [rng.getrandbits(63) for _ in range(count)]
        chunk = list(tokens[start * BLOCK_SIZE : (start + count) * BLOCK_SIZE])
        event = BlockStored(hashes, parent, chunk, BLOCK_SIZE, medium="GPU")
        await index.apply(replica, namespace, EventBatch(time.time(), [event], 0))
        parent = hashes[-1]


async def populate_background(index: BlockIndex, blocks: int, seed: int) -> None:
    """Unrelated cached prompts on every replica, so buckets hold what a fleet's would."""
    rng = random.Random(seed)
    for r in range(REPLICAS):
        for _ in range(blocks // 2_048):
            tokens = [rng.randrange(32_000) for _ in range(2_048 * BLOCK_SIZE)]
            await store(index, f"replica-{r}", tokens, rng)


@dataclass
class Bench:
    """One router (its placer, index and load board) and the text to feed it."""

    name: str
    router: Router
    workload: Workload
    index: BlockIndex

    @property
    def placer(self) -> Decider:
        return self.router.decider

    async def run(self, requests: Sequence[PromptRequest]) -> list[Placement]:
        return [await self.placer.place(request) for request in requests]


def router_settings(redis_url: str | None, tokenizer_dir: Path) -> RouterSettings:
    """Settings of a router in front of 8 replicas (never contacted: no request is sent)."""
    replicas = tuple(
        f"replica-{r}=tcp://127.0.0.1:{9 + r},url=http://127.0.0.1:{9 + r}" for r in range(REPLICAS)
    )
    return RouterSettings(
        redis=redis_url,
        replica=replicas,
        discover=False,
        model=MODEL,
        block_size=BLOCK_SIZE,
        tokenizer=(str(tokenizer_dir),),
        router_id="bench-router",
        lookup_timeout_ms=1_000.0,
    )


async def other_routers_load(board: RedisLoadBoard) -> None:
    """Another router's load on every replica, so every snapshot sums real entries."""
    namespace = Namespace(MODEL, BLOCK_SIZE)
    for r in range(REPLICAS):
        for _ in range(r % 3 + 1):
            board.acquire(namespace, f"replica-{r}", 1_000 * r)
    await board.start()
    for _ in range(500):  # the board pushes in the background
        if board.stats.pushes:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError("the other router's load never reached redis")


async def make_bench(
    name: str, settings: RouterSettings, book: TokenizerBook, workload: Workload, blocks: int
) -> Bench:
    """A router over Redis (``settings.redis``) or the embedded index, with placements."""
    index = open_index(settings.redis)
    client = index.client if isinstance(index, RedisIndex) else None
    router = Router(
        settings, index=index, registry=CollectorRegistry(), redis=client, tokenizers=book
    )
    await populate_background(index, blocks, seed=3)
    return Bench(name, router, workload, index)
