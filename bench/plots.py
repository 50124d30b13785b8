"""PNG plots of a benchmark run (matplotlib, Agg backend): TTFT CDFs; hit rate and throughput.

``FILE`` gets the TTFT CDF of every policy (log scale, simulated ms); ``FILE-bars.png`` the
engine-reported prefix hit rate and output throughput per policy.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from bench.harness import PolicyRun
from bench.report import Summary, latencies_ms


def bars_path(path: Path) -> Path:
    """Where the bar charts go next to the CDF plot ``path``."""
    return path.with_name(f"{path.stem}-bars{path.suffix or '.png'}")


def plot(
    runs: Sequence[PolicyRun],
    summaries: dict[str, Summary],
    time_scale: float,
    path: Path,
    title: str,
) -> list[Path]:
    """Write the two figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        ttft = sorted(latencies_ms(run, time_scale, "ttft"))
        if not ttft:
            continue
        share = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax.step(ttft, share, where="post", label=run.policy, linewidth=1.6)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (simulated H200 ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("\n".join(textwrap.wrap(f"TTFT CDF — {title}", 90)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

    names = list(summaries)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    hits = [summaries[n].hit_rate * 100 for n in names]
    rates = [summaries[n].output_tokens_per_s for n in names]
    colors = [f"C{i}" for i in range(len(names))]
    left.bar(names, hits, color=colors)
    left.set_ylabel("engine-reported prefix hit rate (%)")
    left.set_ylim(0, 100)
    right.bar(names, rates, color=colors)
    right.set_ylabel("output tokens / simulated s")
    for axis, values, fmt in ((left, hits, "{:.0f}%"), (right, rates, "{:,.0f}")):
        axis.tick_params(axis="x", labelrotation=30)
        for i, value in enumerate(values):
            axis.text(i, value, fmt.format(value), ha="center", va="bottom", fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    bars = bars_path(path)
    fig.savefig(bars, dpi=110)
    plt.close(fig)
    return [path, bars]
