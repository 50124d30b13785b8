"""PNG plots of a benchmark run (matplotlib, Agg backend): TTFT CDFs; hit rate and throughput.

``FILE`` gets the TTFT CDF of every policy (log scale, simulated ms); ``FILE-bars.png`` the
engine-reported prefix hit rate and output throughput per policy. matplotlib (the ``bench``
extra) is imported only when a figure is drawn; commands that end with plots call
:func:`require_matplotlib` before they start.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from bench.harness import PolicyRun
from bench.matrix.verdicts import Verdict
from bench.summary import Summary, latencies_ms
from tracker.framework.errors import ConfigError

INSTALL_HINT: Final = "pip install -e '.[bench]'"


def require_matplotlib(option: str) -> None:
    """Raise ConfigError, naming the extra to install, when matplotlib cannot be imported.

    Commands call it before their run when ``option`` asks for plots, so that a missing
    package fails at once instead of after the benchmark.
    """
    try:
        import matplotlib  # noqa: F401 - slow to import: only when plots are asked for
    except ImportError as exc:
        reason = str(exc).partition("\n")[0]
        raise ConfigError(f"{option} needs matplotlib ({reason}): {INSTALL_HINT}") from exc


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


def matrix_plots(verdicts: Sequence[Verdict], directory: Path) -> list[Path]:
    """Per axis of the scenario matrix, hit rate and TTFT p95 of every policy per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # cell labels such as "400" are categories on purpose: no note per label, please
    logging.getLogger("matplotlib.category").setLevel(logging.WARNING)
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for axis in dict.fromkeys(v.cell.axis for v in verdicts):
        cells = [v for v in verdicts if v.cell.axis == axis]
        labels = [v.cell.label for v in cells]
        policies = list(dict.fromkeys(p for v in cells for p in v.summaries))
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for i, policy in enumerate(policies):
            style = {"linewidth": 2.6 if policy == "kvrouter" else 1.3, "marker": "o"}
            hits = [
                v.summaries[policy].hit_rate * 100 if policy in v.summaries else None for v in cells
            ]
            p95 = [
                v.summaries[policy].ttft_ms["p95"] if policy in v.summaries else None for v in cells
            ]
            left.plot(labels, hits, label=policy, color=f"C{i}", **style)
            right.plot(labels, p95, label=policy, color=f"C{i}", **style)
        bound_hits = [
            100 * v.doc.get("bound", {}).get("ideal_hit_rate", float("nan")) for v in cells
        ]
        bound_p95 = [
            v.doc.get("bound", {}).get("ttft_floor_ms", {}).get("p95", float("nan")) for v in cells
        ]
        left.plot(labels, bound_hits, "k--", label="bound (ideal)", linewidth=1)
        right.plot(labels, bound_p95, "k--", label="bound (floor)", linewidth=1)
        left.set_ylabel("engine-reported prefix hit rate (%)")
        left.set_ylim(0, 100)
        right.set_ylabel("TTFT p95 (simulated H200 ms, log)")
        right.set_yscale("log")
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
            ax.set_xlabel(axis)
        right.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
        fig.suptitle(f"scenario matrix — {axis}", fontsize=10)
        fig.tight_layout()
        path = directory / f"matrix-{axis}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)
    return out
