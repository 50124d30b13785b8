"""Write the bundled SYNTHETIC Mooncake-format traces: ``python -m bench.traces.synthesize``.

The real Mooncake traces (``kvcache-ai/Mooncake`` ``FAST25-release/traces/``) cannot be
downloaded here; ``kvrouter bench --workload trace --trace FILE`` replays any of them. This
sample only has their *format*: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (one id per 512-token block; requests
sharing leading ids share those prompt tokens). Its shape is made up, loosely modelled on
agent/chat traffic:

* ``apps`` system prompts of 2-8 blocks, picked with Zipf-like popularity;
* sessions of 1-6 turns; the first turn adds 1-4 blocks of user context to its app's prompt,
  every later turn resends the previous prompt's full blocks plus the previous answer and a
  new question (0-2 new blocks and a partial last block, whose id is always new);
* outputs of 32-512 tokens (log-uniform); sessions start as a Poisson process and turns
  follow each other after 2-20 s of think time.

``--profile conversation`` (:func:`conversations`, bundled as ``synthetic_conversation.jsonl``)
is shaped like the statistics published for Mooncake's conversation trace: long chat
sessions whose prompts are ~7k tokens at the median and ~12k on average, outputs of ~340
tokens, a few requests per second, about a third of the prompt blocks shared (system prompts
and the growing history of a session):

* ``apps`` system prompts of 1-4 blocks with Zipf-like popularity;
* a session's first turn adds a user document of log-normally many blocks (median 12, capped
  at 120); each later turn resends the whole previous prompt, the previous answer (its own new
  ids) and a question of 0-2 blocks;
* turns per session geometric (mean 1.6), think time log-normal (median 20 s); outputs
  log-normal (median 250, mean ~340 tokens, at most 2,000).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from pathlib import Path
from typing import Any, Final

BLOCK = 512
DEFAULT_OUT = Path(__file__).with_name("synthetic_mooncake_sample.jsonl")


class _FreshIds:
    """Hash ids no record has used yet, counting up from ``start``."""

    def __init__(self, start: int = 0) -> None:
        self._next = start

    def __call__(self, n: int) -> list[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        return ids


def synthesize(
    *, sessions: int = 160, apps: int = 8, rate: float = 2.0, seed: int = 2025
) -> list[dict[str, Any]]:
    """The trace's records, ordered by timestamp."""
    rng = random.Random(seed)
    fresh = _FreshIds()

    prompts = [fresh(rng.randint(2, 8)) for _ in range(apps)]
    weights = [1.0 / (i + 1) for i in range(apps)]
    records: list[dict[str, Any]] = []
    start = 0.0
    for _ in range(sessions):
        start += rng.expovariate(rate)
        at = start
        full = prompts[rng.choices(range(apps), weights)[0]] + fresh(rng.randint(1, 4))
        for turn in range(rng.randint(1, 6)):
            if turn:
                at += rng.uniform(2.0, 20.0)
                full = full + fresh(rng.randint(0, 2) + 1)  # last answer + new question
            tail = rng.randint(1, BLOCK - 1)
            output = round(math.exp(rng.uniform(math.log(32), math.log(512))))
            records.append(
                {
                    "timestamp": round(at * 1000),
                    "input_length": len(full) * BLOCK + tail,
                    "output_length": output,
                    "hash_ids": [*full, *fresh(1)],
                }
            )
    records.sort(key=lambda r: int(r["timestamp"]))
    return records


def conversations(
    *, requests: int = 600, rate: float = 3.0, apps: int = 30, seed: int = 2026
) -> list[dict[str, Any]]:
    """A conversation-shaped trace of ``requests`` records at about ``rate`` per second."""
    rng = random.Random(seed)
    fresh = _FreshIds()

    prompts = [fresh(rng.randint(1, 4)) for _ in range(apps)]
    weights = [1.0 / (i + 1) for i in range(apps)]
    turns_per_session = 1.6
    horizon = 1.25 * requests / rate  # turns past the horizon are cut: start more sessions
    records: list[dict[str, Any]] = []
    start = 0.0
    while start < horizon:
        start += rng.expovariate(rate / turns_per_session)
        at = start
        document = min(120, max(1, round(rng.lognormvariate(math.log(12), 1.0))))
        full = prompts[rng.choices(range(apps), weights)[0]] + fresh(document)
        output = 0
        turn = 0
        while True:
            if turn:
                at += rng.lognormvariate(math.log(20.0), 0.8)
                answer = fresh(max(1, math.ceil(output / BLOCK)))
                full = full + answer + fresh(rng.randint(0, 2))
            tail = rng.randint(1, BLOCK - 1)
            output = min(2000, max(8, round(rng.lognormvariate(math.log(250), 0.8))))
            records.append(
                {
                    "timestamp": round(at * 1000),
                    "input_length": len(full) * BLOCK + tail,
                    "output_length": output,
                    "hash_ids": [*full, *fresh(1)],
                }
            )
            turn += 1
            if rng.random() < 1.0 / turns_per_session or at > horizon:
                break
    records.sort(key=lambda r: int(r["timestamp"]))
    return [r for r in records if r["timestamp"] <= horizon * 1000][:requests]


# Quantiles of Mooncake's conversation trace (FAST25-release/traces/conversation_trace.jsonl,
# all 12,031 requests), (quantile, tokens): what --profile mooncake draws new sessions from.
MOONCAKE_INPUT: Final = (
    (0.0, 891), (0.1, 964), (0.2, 1662), (0.3, 3263), (0.4, 4993), (0.5, 6909),
    (0.6, 9570), (0.7, 13196), (0.8, 17869), (0.9, 27367), (0.95, 39549), (0.97, 52215),
    (0.99, 85399), (0.995, 100381), (1.0, 126195),
)  # fmt: skip
MOONCAKE_OUTPUT: Final = (
    (0.0, 1), (0.1, 24), (0.2, 100), (0.3, 213), (0.4, 291), (0.5, 350), (0.6, 399),
    (0.7, 447), (0.8, 504), (0.9, 597), (0.95, 698), (0.99, 1115), (1.0, 2000),
)  # fmt: skip


def _quantile(table: tuple[tuple[float, int], ...], u: float) -> int:
    """The value at quantile ``u`` of ``table``, log-linear between its points."""
    for (q0, v0), (q1, v1) in itertools.pairwise(table):
        if u <= q1:
            share = (u - q0) / (q1 - q0) if q1 > q0 else 0.0
            return round(math.exp(math.log(v0) + share * (math.log(v1) - math.log(v0))))
    return table[-1][1]


def mooncake_like(
    *, requests: int = 1200, continue_share: float = 0.385, seed: int = 2027
) -> list[dict[str, Any]]:
    """A trace shaped like Mooncake's conversation trace, for when it cannot be downloaded
    (``scripts/fetch-trace``): the same bursts (every 3 s, ~10 requests each), every prompt
    opening with the same 512-token block, ``continue_share`` of the requests continuing an
    earlier one (its whole prompt plus 1-4 new blocks), the others new sessions whose lengths
    and every output follow the real trace's quantiles (:data:`MOONCAKE_INPUT`)."""
    rng = random.Random(seed)
    fresh = _FreshIds(1)  # id 0: the block every prompt opens with

    open_sessions: list[list[int]] = []
    records: list[dict[str, Any]] = []
    at = 0
    while len(records) < requests:
        size = max(1, round(rng.gauss(10, 3)))
        for _ in range(min(size, requests - len(records))):
            if open_sessions and rng.random() < continue_share:
                index = rng.randrange(len(open_sessions))
                full = open_sessions[index] + fresh(rng.randint(1, 4))
                open_sessions[index] = full
            else:
                tokens = _quantile(MOONCAKE_INPUT, rng.random())
                full = [0, *fresh(max(0, math.ceil(tokens / BLOCK) - 2))]
                open_sessions.append(full)
                open_sessions = open_sessions[-300:]
            records.append(
                {
                    "timestamp": at,
                    "input_length": len(full) * BLOCK + rng.randint(1, BLOCK - 1),
                    "output_length": _quantile(MOONCAKE_OUTPUT, rng.random()),
                    "hash_ids": [*full, *fresh(1)],
                }
            )
        at += 3000
    return records


def describe(records: list[dict[str, Any]]) -> str:
    """Median and mean prompt, mean output, rate and the share of blocks seen before."""
    lengths = sorted(int(r["input_length"]) for r in records)
    seen: set[int] = set()
    reused = total = 0
    for record in records:
        ids = record["hash_ids"]
        reused += sum(1 for h in ids if h in seen)
        total += len(ids)
        seen.update(ids)
    span = (int(records[-1]["timestamp"]) - int(records[0]["timestamp"])) / 1000 or 1.0
    mean_out = sum(int(r["output_length"]) for r in records) / len(records)
    return (
        f"{len(records)} requests, prompt median {lengths[len(lengths) // 2]:,} / mean "
        f"{sum(lengths) / len(lengths):,.0f} tokens, output mean {mean_out:.0f}, "
        f"{len(records) / span:.1f} req/s, {reused / total:.0%} of blocks seen before"
    )


CONVERSATION_OUT = Path(__file__).with_name("synthetic_conversation.jsonl")
MOONCAKE_OUT = Path(__file__).with_name("synthetic_mooncake_conversation.jsonl")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--profile", choices=("sample", "conversation", "mooncake"), default="sample"
    )
    parser.add_argument("--out", type=Path, help="default: the bundled file of the profile")
    parser.add_argument("--seed", type=int, help="default: the bundled file's")
    parser.add_argument("--requests", type=int, default=600, help="conversation: records")
    parser.add_argument("--rate", type=float, default=3.0, help="conversation: req/s")
    args = parser.parse_args()
    if args.profile == "mooncake":
        records = mooncake_like(seed=2027 if args.seed is None else args.seed)
        out = args.out or MOONCAKE_OUT
    elif args.profile == "conversation":
        records = conversations(
            requests=args.requests, rate=args.rate, seed=2026 if args.seed is None else args.seed
        )
        out = args.out or CONVERSATION_OUT
    else:
        records = synthesize(seed=2025 if args.seed is None else args.seed)
        out = args.out or DEFAULT_OUT
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {out}: {describe(records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
