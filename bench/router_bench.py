"""Router benchmark: decision overhead per stage, proxy throughput and per-chunk latency.

The decision is timed through the router's own objects over a populated index (Redis or
embedded), the data path by :mod:`bench.proxy_load`; method, targets and results are in
docs/results.md ("What a request pays for the router"). ``python -m bench.router_bench``
writes bench/results/router.json and prints two tables.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import msgspec
from prometheus_client import CollectorRegistry

from bench.corpus import Lexicon, train_tokenizer
from bench.proxy_load import ProxySettings, measure, percentile, proxy_table
from bench.stack.redis_servers import RedisServer
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
from tracker.framework.cli import parse_argv
from tracker.framework.errors import ConfigError
from tracker.framework.settings import Settings, comma_list, setting

MODEL: Final = "bench-model"
BLOCK_SIZE: Final = 16
REPLICAS: Final = 8
QUESTION_TOKENS: Final = 100
EVENT_BLOCKS: Final = 512  # blocks per BlockStored: one 8k-token chunked-prefill step
SESSION_FROM_TOKENS: Final = 32_000  # prompt sizes with a growing-session case
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


async def store(
    index: BlockIndex,
    replica: str,
    tokens: Sequence[int],
    rng: random.Random,
    *,
    first: int = 0,
    parent: ExternalHash | None = None,
) -> ExternalHash | None:
    """Index ``tokens``' full blocks from block ``first`` on (after the block of engine hash
    ``parent``) on ``replica`` as its engine's prefill events would; returns the engine hash
    of the last block stored."""
    namespace = Namespace(MODEL, BLOCK_SIZE)
    whole = len(tokens) // BLOCK_SIZE
    for start in range(first, whole, EVENT_BLOCKS):
        count = min(EVENT_BLOCKS, whole - start)
        hashes: list[ExternalHash] = [rng.getrandbits(63) for _ in range(count)]
        chunk = list(tokens[start * BLOCK_SIZE : (start + count) * BLOCK_SIZE])
        event = BlockStored(hashes, parent, chunk, BLOCK_SIZE, medium="GPU")
        await index.apply(replica, namespace, EventBatch(time.time(), [event], 0))
        parent = hashes[-1]
    return parent


async def populate_background(index: BlockIndex, blocks: int, seed: int) -> None:
    """Unrelated cached prompts on every replica, so buckets hold what a fleet's would."""
    rng = random.Random(seed)
    for r in range(REPLICAS):
        for _ in range(blocks // 2_048):
            tokens = [rng.randrange(32_000) for _ in range(2_048 * BLOCK_SIZE)]
            await store(index, f"replica-{r}", tokens, rng)


@dataclass
class Bench:
    """One router (its decision core, index and load board) and the text to feed it."""

    name: str
    router: Router
    workload: Workload
    index: BlockIndex

    @property
    def decider(self) -> Decider:
        return self.router.decider

    async def run(self, requests: Sequence[PromptRequest]) -> list[Placement]:
        return [await self.decider.place(request) for request in requests]


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


STAGES: Final = ("tokenize", "hash", "lookup", "score", "total")
# The router's default lookup budget. The benchmark lifts it to time whole lookups, and counts
# those that would have run over it (the router then routes on load alone).
DEFAULT_BUDGET_MS: Final[float] = RouterSettings().lookup_timeout_ms


def summary_ms(samples: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / mean of second samples, in ms."""
    return {
        "p50_ms": percentile(samples, 50) * 1e3,
        "p99_ms": percentile(samples, 99) * 1e3,
        "mean_ms": statistics.fmean(samples) * 1e3,
    }


def stage_summary(placements: Sequence[Placement]) -> dict[str, Any]:
    stages = {s: summary_ms([p.stages[s] for p in placements]) for s in STAGES}
    return {
        "samples": len(placements),
        "prompt_tokens_mean": statistics.fmean(p.prompt_tokens for p in placements),
        "blocks_mean": statistics.fmean(len(p.keys) for p in placements),
        "matched_blocks_max": max(
            (m.blocks for p in placements for m in p.matches.values()), default=0
        ),
        "fallbacks": dict(Counter(p.fallback for p in placements if p.fallback)),
        "over_default_budget": sum(
            p.stages["lookup"] * 1e3 > DEFAULT_BUDGET_MS for p in placements
        ),
        "stages": stages,
    }


async def repeated_prefix(
    benches: Sequence[Bench], size: int, iterations: int, rng: random.Random
) -> dict[str, dict[str, Any]]:
    """The same long prefix with a new question each request, on each bench's index.

    Replica r holds the first (8 - r) / 8 of an earlier request with this prefix.
    """
    workload = benches[0].workload
    prefix = workload.conversation(rng, size - QUESTION_TOKENS)
    tokenizer = benches[0].decider.tokenizers.for_model(MODEL).tokenizer
    served = tokenizer.chat_token_ids([*prefix, workload.question(rng)])
    warmup = 3
    results = {}
    for bench in benches:  # each with its own questions: a question seen before is cached
        requests = [
            chat_request([*prefix, workload.question(rng)]) for _ in range(iterations + warmup)
        ]
        depth_rng = random.Random(size)
        for r in range(REPLICAS):
            depth = len(served) * (REPLICAS - r) // REPLICAS
            await store(bench.index, f"replica-{r}", served[:depth], depth_rng)
        gc.collect()
        placements = (await bench.run(requests))[warmup:]
        result = stage_summary(placements)
        result["chosen"] = dict(Counter(p.decision.replica for p in placements))
        if isinstance(bench.index, RedisIndex):
            result["server_walk_ms"] = await server_walk_ms(bench.index, placements[-1].keys)
        results[bench.name] = result
    return results


async def index_miss(
    bench: Bench, size: int, iterations: int, rng: random.Random
) -> dict[str, Any]:
    """A long prefix the tokenizer has seen but no replica holds (evicted everywhere): the
    lookup stops at the first block."""
    workload = bench.workload
    prefix = workload.conversation(rng, size - QUESTION_TOKENS)
    requests = [chat_request([*prefix, workload.question(rng)]) for _ in range(iterations + 3)]
    gc.collect()
    placements = (await bench.run(requests))[3:]
    result = stage_summary(placements)
    if isinstance(bench.index, RedisIndex):
        result["server_walk_ms"] = await server_walk_ms(bench.index, placements[-1].keys)
    return result


async def growing_session(
    bench: Bench, size: int, turns: int, rng: random.Random, turn_tokens: int = 2_000
) -> dict[str, Any]:
    """An agent's session: each turn is the previous prompt, its answer and a new tool result
    of ``turn_tokens``, from ``size`` - ``turns`` x ``turn_tokens`` / 2 tokens on; after each
    decision replica 0 holds the prompt (its engine prefilled it) and the replicas r > 0 the
    first (8 - r) / 8 of the session's first prompt."""
    workload = bench.workload
    tokenizer = bench.decider.tokenizers.for_model(MODEL).tokenizer
    messages = workload.conversation(rng, max(4_000, size - turns * turn_tokens // 2))
    depth_rng = random.Random(size + 1)
    first = tokenizer.chat_token_ids(messages)
    for r in range(1, REPLICAS):
        await store(
            bench.index, f"replica-{r}", first[: len(first) * (REPLICAS - r) // REPLICAS], depth_rng
        )
    held, parent = 0, None
    placements: list[Placement] = []
    gc.collect()
    for turn in range(turns + 1):
        messages.append({"role": "assistant", "content": workload.lexicon.text(rng, 400)})
        messages.append(
            {
                "role": "user",
                "content": workload.lexicon.text(
                    rng, round(turn_tokens * workload.chars_per_token)
                ),
            }
        )
        placement = await bench.decider.place(chat_request(messages))
        if turn:  # the first turn tokenizes the whole session
            placements.append(placement)
        served = tokenizer.chat_token_ids(messages)
        parent = await store(bench.index, "replica-0", served, depth_rng, first=held, parent=parent)
        held = len(served) // BLOCK_SIZE
    result = stage_summary(placements)
    result["matched_blocks_mean"] = statistics.fmean(
        p.matches["replica-0"].blocks for p in placements if "replica-0" in p.matches
    )
    if isinstance(bench.index, RedisIndex):
        result["server_walk_ms"] = await server_walk_ms(bench.index, placements[-1].keys)
    return result


async def server_walk_ms(index: RedisIndex, keys: list[int], calls: int = 20) -> float:
    """Redis' own time per lookup script call (INFO commandstats), without the round trip."""
    namespace = Namespace(MODEL, BLOCK_SIZE)
    await index.client.config_resetstat()
    for _ in range(calls):
        await index.lookup(namespace, keys)
    stats = await index.client.info("commandstats")
    return float(stats["cmdstat_evalsha"]["usec_per_call"]) / 1e3


async def never_seen(
    bench: Bench, size: int, iterations: int, rng: random.Random
) -> dict[str, Any]:
    """A brand-new conversation every request; also the raw tokenizer on the same text."""
    tokenizer = bench.decider.tokenizers.for_model(MODEL).tokenizer
    placements: list[Placement] = []
    raw: list[float] = []
    ratios: list[float] = []
    gc.collect()
    for i in range(iterations + 1):
        messages = [*bench.workload.conversation(rng, size - QUESTION_TOKENS)]
        messages.append(bench.workload.question(rng))
        request = chat_request(messages)
        text = tokenizer.render_chat(messages)

        def encode(text: str = text) -> float:
            start = time.perf_counter()
            tokenizer.hf.encode(text, add_special_tokens=False)
            return time.perf_counter() - start

        # Alternate the order: neither side always runs right after the other.
        if i % 2:
            seconds = encode()
            placement = await bench.decider.place(request)
        else:
            placement = await bench.decider.place(request)
            seconds = encode()
        if i == 0:
            continue  # warm-up
        placements.append(placement)
        raw.append(seconds)
        ratios.append(placement.stages["total"] / seconds)
    result = stage_summary(placements)
    result["raw_encode"] = summary_ms(raw)
    result["raw_us_per_token"] = statistics.fmean(raw) / result["prompt_tokens_mean"] * 1e6
    result["ratio_to_raw"] = {"p50": percentile(ratios, 50), "p99": percentile(ratios, 99)}
    return result


async def decision_overhead(
    sizes: Sequence[int], iterations: Callable[[int, str], int], background_blocks: int
) -> dict[str, Any]:
    """Decision overhead per prompt size: repeated prefix (Redis, embedded) and never-seen."""
    started = time.perf_counter()
    lexicon = Lexicon()
    with tempfile.TemporaryDirectory(prefix="kvr-router-bench-") as tmp:
        tokenizer_dir = train_tokenizer(lexicon, Path(tmp) / "tokenizer")
        trained_s = time.perf_counter() - started
        server = RedisServer().start()
        try:
            settings = router_settings(server.url, tokenizer_dir)
            book = TokenizerBook.load(settings)
            hf = book.default.tokenizer.hf
            sample = lexicon.text(random.Random(5), 400_000)
            hf.encode(sample)  # warm the BPE word cache, as a running router's is
            begin = time.perf_counter()
            sample_ids = hf.encode(sample, add_special_tokens=False).ids
            us_per_token = (time.perf_counter() - begin) / len(sample_ids) * 1e6
            workload = Workload(lexicon, len(sample) / len(sample_ids))
            redis = await make_bench("redis", settings, book, workload, background_blocks)
            embedded_settings = router_settings(None, tokenizer_dir)
            embedded = await make_bench(
                "embedded", embedded_settings, book, workload, background_blocks
            )
            assert isinstance(redis.index, RedisIndex)
            other = RedisLoadBoard(
                redis.index.client,
                "bench-other-router",
                lease_ttl_s=settings.lease_ttl_s,
                renew_interval_s=settings.load_renew_s,
            )
            await other_routers_load(other)
            rng = random.Random(17)
            sizes_out: dict[str, Any] = {}
            for size in sizes:
                repeated = await repeated_prefix(
                    [redis, embedded], size, iterations(size, "repeated"), rng
                )
                sizes_out[str(size)] = {
                    "repeated_prefix": repeated["redis"],
                    "repeated_prefix_embedded": repeated["embedded"],
                    "index_miss": await index_miss(redis, size, iterations(size, "repeated"), rng),
                    "never_seen": await never_seen(redis, size, iterations(size, "never"), rng),
                }
                if size >= SESSION_FROM_TOKENS:
                    sizes_out[str(size)]["growing_session"] = await growing_session(
                        redis, size, iterations(size, "session"), rng
                    )
            stats = book.default.stats
            await other.stop()
            for bench in (redis, embedded):
                await bench.router.stop()
            await redis.index.close()
        finally:
            server.close()
    return {
        "tokenizer": {
            "kind": "byte-level BPE trained on generated English-like text (bench/corpus.py)",
            "vocab_size": hf.get_vocab_size(),
            "train_s": trained_s,
            "segmented": book.default.segmented,
            "chars_per_token": workload.chars_per_token,
            "us_per_token_one_thread": us_per_token,
        },
        "replicas": REPLICAS,
        "block_size": BLOCK_SIZE,
        "background_blocks_per_replica": background_blocks,
        "lookup_budget_ms_default": DEFAULT_BUDGET_MS,
        "segment_cache": {
            "hits": stats.hits,
            "misses": stats.misses,
            "hit_tokens": stats.hit_tokens,
            "miss_tokens": stats.miss_tokens,
        },
        "sizes": sizes_out,
    }


def decision_table(results: dict[str, Any]) -> str:
    header = (
        f"{'tokens':>7}  {'case':<17} {'n':>4} {'tokenize':>13} {'hash':>11} {'lookup':>11} "
        f"{'score':>9} {'total':>13}  {'raw':>6} {'x raw':>5}  >budget"
    )
    lines = ["decision overhead, ms p50/p99 per stage", header, "-" * len(header)]
    cases = (
        ("repeated_prefix", "repeated, redis"),
        ("repeated_prefix_embedded", "repeated, embedded"),
        ("index_miss", "miss, redis"),
        ("growing_session", "session, redis"),
        ("never_seen", "never-seen, redis"),
    )
    for by_case in results["sizes"].values():
        for case, label in cases:
            if case not in by_case:
                continue
            r = by_case[case]

            def pair(stage: str, stages: dict[str, Any] = r["stages"]) -> str:
                return f"{stages[stage]['p50_ms']:.2f}/{stages[stage]['p99_ms']:.2f}"

            raw = f"{r['raw_encode']['p50_ms']:.1f}" if "raw_encode" in r else "-"
            ratio = f"{r['ratio_to_raw']['p50']:.2f}" if "ratio_to_raw" in r else "-"
            over = r["over_default_budget"] if label.endswith("redis") else "-"
            lines.append(
                f"{r['prompt_tokens_mean']:>7,.0f}  {label:<17} {r['samples']:>4} "
                f"{pair('tokenize'):>13} {pair('hash'):>11} {pair('lookup'):>11} "
                f"{pair('score'):>9} {pair('total'):>13}  {raw:>6} {ratio:>5}  {over}"
            )
    for case, label in (
        ("repeated_prefix", "repeated prefix"),
        ("index_miss", "miss"),
        ("growing_session", "session"),
    ):
        walks = [
            f"{by_case[case]['prompt_tokens_mean']:,.0f} tokens "
            f"{by_case[case]['server_walk_ms']:.2f} ms"
            for by_case in results["sizes"].values()
            if case in by_case
        ]
        lines.append(f"lookup script time inside redis-server ({label}): " + ", ".join(walks))
    tok = results["tokenizer"]
    lines.append(
        f"tokenizer: {tok['vocab_size']:,}-token BPE, {tok['chars_per_token']:.2f} chars/token, "
        f"{tok['us_per_token_one_thread']:.2f} us/token (HF encode, one thread)"
    )
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class RouterBenchSettings(Settings):
    """``python -m bench.router_bench``: which parts run, and how long."""

    PART = "ROUTER_BENCH"

    quick: bool = setting(False, "fewer iterations and requests")
    sizes: str = setting("1000,8000,32000,100000", "prompt tokens")
    skip_decision: bool = setting(False, "leave out the decision overhead")
    skip_proxy: bool = setting(False, "leave out the proxy part")
    workers: int = setting(1, "router processes (proxy part)")
    json: str = setting("bench/results/router.json", "where the JSON document goes")

    def __post_init__(self) -> None:
        if not self.size_list:  # int() refuses a size that is not a number
            raise ConfigError("sizes: give at least one prompt size")

    @property
    def size_list(self) -> list[int]:
        return list(comma_list(self.sizes, int))


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_argv(RouterBenchSettings, argv, description=__doc__.split("\n")[0])
    scale = 0.2 if settings.quick else 1.0

    def iterations(size: int, case: str) -> int:
        # a never-seen request costs a full tokenization, twice
        if case == "session":  # turns of 2k tokens, each tokenized anew
            return max(5, round(40 * scale))
        base = (400 if size <= 8_000 else 200) if case == "repeated" else 2_000_000 // size
        return max(5, round(min(base, 400 if case == "repeated" else 200) * scale))

    # The machine is shared: say how busy it was (1-minute load average) around each part.
    results: dict[str, Any] = {"load_average": {"start": os.getloadavg()[0]}}
    if not settings.skip_decision:
        sizes = settings.size_list
        blocks = 8_192 if settings.quick else 16_384
        results["decision"] = asyncio.run(decision_overhead(sizes, iterations, blocks))
        results["load_average"]["after_decision"] = os.getloadavg()[0]
        print(decision_table(results["decision"]))
    if not settings.skip_proxy:
        proxy = replace(
            ProxySettings.quick() if settings.quick else ProxySettings(), workers=settings.workers
        )
        results["proxy"] = measure(proxy)
        results["load_average"]["after_proxy"] = os.getloadavg()[0]
        print()
        print(proxy_table(results["proxy"]))
    print(f"1-minute load average: {results['load_average']}")
    path = Path(settings.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwritten {settings.json}")


if __name__ == "__main__":
    main()
