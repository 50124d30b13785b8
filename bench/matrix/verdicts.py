"""A matrix cell's verdict: kvrouter against the best real peer (:data:`bench.peers.PEERS`) on
TTFT p50, p95 and the engines' prefix hit rate, read from the cell's result document."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from bench.matrix.cells import Cell
from bench.peers import PEERS
from bench.report import from_document
from bench.summary import Summary

_TOLERANCE: Final = 0.03


def headline(summary: Summary) -> dict[str, float]:
    """What a pass's verdict reads: TTFT p50 and p95 and the hit rate."""
    return {
        "p50": summary.ttft_ms["p50"],
        "p95": summary.ttft_ms["p95"],
        "hit_rate": summary.hit_rate,
    }


@dataclass
class Verdict:
    """kvrouter against the best real peer in one cell (NaN where nothing to compare)."""

    cell: Cell
    doc: dict[str, Any]
    summaries: dict[str, Summary]
    best: dict[str, tuple[str, float]] = field(default_factory=dict)

    @property
    def kv(self) -> Summary | None:
        return self.summaries.get("kvrouter")

    def ratio(self, metric: str) -> float:
        """Best peer's latency over kvrouter's (> 1: kvrouter better); hit rate: points."""
        kv, best = self.kv, self.best.get(metric)
        if kv is None or best is None:
            return math.nan
        if metric == "hit_rate":
            return 100.0 * (kv.hit_rate - best[1])
        mine = kv.ttft_ms[metric]
        return best[1] / mine if mine else math.nan

    def beside(self) -> tuple[float, float]:
        """Outside the goal, for how a cell is read: the lowest mean TTFT of any peer over
        kvrouter's, and kvrouter's output tokens/s over the highest of any peer (> 1: kvrouter
        better). A router that sacrifices one engine under overload has the lower median;
        the mean and the throughput show what that cost (NaN where nothing to compare)."""
        kv = self.kv
        peers = [s for name, s in self.summaries.items() if name in PEERS]
        if kv is None or not peers:
            return math.nan, math.nan
        mean = min(s.ttft_ms["mean"] for s in peers)
        rate = max(s.output_tokens_per_s for s in peers)
        mine = kv.ttft_ms["mean"]
        return (
            mean / mine if mine else math.nan,
            kv.output_tokens_per_s / rate if rate else math.nan,
        )

    @property
    def ties(self) -> bool:
        """At least the best peer's TTFT p50, p95 and hit rate, within 3 %."""
        kv = self.kv
        if kv is None or not self.best:
            return False
        latency = all(kv.ttft_ms[q] <= (1 + _TOLERANCE) * self.best[q][1] for q in ("p50", "p95"))
        return latency and kv.hit_rate >= (1 - _TOLERANCE) * self.best["hit_rate"][1]

    @property
    def wins(self) -> bool:
        """Strictly better: >= 1.3x on TTFT p95 or >= 5 points of hit rate."""
        return self.ratio("p95") >= 1.3 or self.ratio("hit_rate") >= 5.0

    @property
    def met(self) -> bool:
        return self.ties and (self.wins or not self.cell.events)


def verdict(cell: Cell, doc: dict[str, Any]) -> Verdict:
    summaries, _ = from_document(doc)
    best = best_peers({name: headline(s) for name, s in summaries.items()})
    return Verdict(cell, doc, summaries, best)


def best_peers(headlines: Mapping[str, Mapping[str, float]]) -> dict[str, tuple[str, float]]:
    """The best real peer per metric of :func:`headline`'s: the lowest TTFT p50 and p95, the
    highest hit rate (empty where no peer ran)."""
    peers = {name: h for name, h in headlines.items() if name in PEERS}
    if not peers:
        return {}
    out = {}
    for metric in ("p50", "p95"):
        name = min(peers, key=lambda n: peers[n][metric])
        out[metric] = (name, peers[name][metric])
    name = max(peers, key=lambda n: peers[n]["hit_rate"])
    out["hit_rate"] = (name, peers[name]["hit_rate"])
    return out
