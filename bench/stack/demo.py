"""``kvrouter demo``: the local stack, and one short shared-prefix workload through
round-robin and then kvrouter, side by side (``kvrouter bench --quick`` with two policies).

It prints TTFT, the engines' own prefix-cache hit rate and how many engines each prompt
group was spread over. ``--embedded``: one router with its in-process tracker, no Redis;
``--vllm``: real vLLM engines (``scripts/vllm-install``), real milliseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console as RichConsole
from rich.table import Table

from bench.commands import BenchSettings, plan
from bench.console import Console, summaries_of
from bench.harness import Harness, PolicyRun
from bench.summary import engines_per_group
from tracker.framework.cli import Command
from tracker.framework.config import LogSettings
from tracker.framework.settings import setting


@dataclass(frozen=True, kw_only=True)
class DemoSettings(LogSettings):
    """``kvrouter demo``: the local stack and a short shared-prefix workload, two policies."""

    PART = "DEMO"

    embedded: bool = setting(False, "one router with its in-process tracker, no Redis/haproxy")
    replicas: int | None = setting(None, "engines (default 4 simulated, 2 vLLM)")
    groups: int = setting(8, "groups of requests sharing a system prompt")
    per_group: int = setting(8, "requests per group")
    prefix_tokens: int = setting(
        1024,
        "length of each group's shared system prompt, in characters (a token each when simulated)",
    )
    output_tokens: int = setting(128, "tokens generated per request")
    num_blocks: int = setting(512, "KV-cache blocks per engine (16 tokens each; 32 with --vllm)")
    load: float = setting(0.75, "arrival rate as a share of the fleet's estimated capacity")
    rate: float | None = setting(
        None, "arrival rate in requests per (simulated) second; wins over load"
    )
    time_scale: float = setting(2.0, "engine time scale (real seconds per simulated H200 second)")
    seed: int = setting(1, "workload seed")
    vllm: str | None = setting(
        None,
        "real vLLM engines instead of simulated ones: the vllm entry point of their "
        "virtualenv (scripts/vllm-install makes .venv-vllm/bin/vllm); real time",
    )
    vllm_model: str = setting(
        ".cache/tiny-qwen2", "with --vllm: the model directory the engines serve"
    )


def compare(runs: Sequence[PolicyRun], time_scale: float, out: RichConsole) -> None:
    """The side-by-side table and the ratios."""
    summaries = summaries_of(runs, time_scale)
    title = "latencies in ms" if time_scale == 1.0 else "latencies in simulated H200 ms"
    table = Table(title=title, title_justify="left")
    for name in ("policy", "TTFT p50", "TTFT p95", "E2E p50", "hit rate", "engines/group"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for run in runs:
        s = summaries[run.policy]
        table.add_row(
            run.policy,
            f"{s.ttft_ms['p50']:,.0f}",
            f"{s.ttft_ms['p95']:,.0f}",
            f"{s.e2e_ms['p50']:,.0f}",
            f"{s.hit_rate:.1%}",
            f"{engines_per_group([r for r in run.results if r.ok]):.1f}",
        )
    out.print(table)
    rr, kv = summaries.get("round-robin"), summaries.get("kvrouter")
    if rr is not None and kv is not None:
        out.print(
            f"kvrouter vs round-robin: TTFT p50 {rr.ttft_ms['p50'] / kv.ttft_ms['p50']:.1f}x, "
            f"p95 {rr.ttft_ms['p95'] / kv.ttft_ms['p95']:.1f}x lower; the engines served "
            f"{kv.hit_rate:.0%} of prompt tokens from their prefix cache instead of "
            f"{rr.hit_rate:.0%}."
        )


def run(settings: DemoSettings) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    bench = BenchSettings(
        workload="gsp",
        policies="round-robin,kvrouter",
        quick=True,
        replicas=settings.replicas,
        routers=1 if settings.embedded else 2,
        embedded=settings.embedded,
        time_scale=settings.time_scale,
        load=settings.load,
        rate=settings.rate,
        seed=settings.seed,
        num_blocks=settings.num_blocks,
        groups=settings.groups,
        prompts_per_group=settings.per_group,
        system_tokens=settings.prefix_tokens,
        output_tokens=settings.output_tokens,
        vllm=settings.vllm,
        vllm_model=settings.vllm_model,
    )
    chosen = plan(bench)
    console = Console()
    console.plan(chosen)
    harness = Harness(chosen.fleet, chosen.workload, chosen.policies, console)
    layout = harness.stack.layout
    console.out.print(f"entry point {layout.entry_url}; engines {', '.join(layout.replica_urls)}")
    runs = harness.run()
    console.out.print()
    compare(runs, chosen.fleet.time_scale, console.out)
    failed = sum(1 for r in runs for result in r.results if not result.ok)
    return 1 if failed else 0


DEMO = Command(
    "demo",
    "start the stack locally; compare round-robin and kvrouter on a shared-prefix workload",
    DemoSettings,
    run,
)
