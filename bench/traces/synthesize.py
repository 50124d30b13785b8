"""Write the bundled SYNTHETIC Mooncake-format trace: ``python -m bench.traces.synthesize``.

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
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

BLOCK = 512
DEFAULT_OUT = Path(__file__).with_name("synthetic_mooncake_sample.jsonl")


def synthesize(
    *, sessions: int = 160, apps: int = 8, rate: float = 2.0, seed: int = 2025
) -> list[dict[str, Any]]:
    """The trace's records, ordered by timestamp."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=2025)
    args = parser.parse_args()
    records = synthesize(seed=args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} synthetic requests to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
