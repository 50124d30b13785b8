"""The router's Prometheus metrics, and the detector of a silent block-key mismatch.

:class:`MismatchDetector` compares every response's engine-reported cached tokens with the
router's prediction: a router whose block keys differ from the tracker's (wrong block size,
model name, chat template or tokenizer) predicts no hits while engines report them, and
``kvrouter_router_hash_mismatch`` says so. Under ``--workers N`` :func:`exposition` answers
for every worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from typing import Final, Generic, Literal, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

logger = logging.getLogger(__name__)

LATENCY_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
STAGE_BUCKETS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
RETURN_BUCKETS: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RATIO_BUCKETS: Final = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
WARN_EVERY_S: Final = 60.0
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"


def exposition(registry: CollectorRegistry) -> bytes:
    """The ``/metrics`` page: ``registry``, or every worker's metrics under ``--workers``."""
    if os.environ.get(MULTIPROC_ENV):
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        return generate_latest(merged)
    return generate_latest(registry)


_M = TypeVar("_M", Counter, Gauge, Histogram)


class Labelled(Generic[_M]):
    """A labelled metric whose children are made once per label values: prometheus_client's
    ``labels()`` validates the values and takes a lock on every call (~2 µs; a request
    makes about fifteen)."""

    __slots__ = ("_children", "metric")
    metric: _M
    _children: dict[tuple[str, ...], _M]

    def __init__(self, metric: _M) -> None:
        self.metric = metric
        self._children = {}

    def labels(self, *values: str) -> _M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values: str) -> None:
        """Drop the child of ``values`` (KeyError if there is none)."""
        self._children.pop(values, None)
        self.metric.remove(*values)


class RouterMetrics:
    """Every metric of one router, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Labelled[Counter]:
            return Labelled(Counter(f"kvrouter_router_{name}", doc, labels, registry=registry))

        def gauge(
            name: str,
            doc: str,
            labels: tuple[str, ...] = (),
            *,
            workers: Literal["livesum", "livemax", "livemin"],
        ) -> Gauge:
            return Gauge(
                f"kvrouter_router_{name}", doc, labels, registry=registry, multiprocess_mode=workers
            )

        self.requests = counter(
            "requests",
            "Requests answered, by endpoint, status and replica",
            ("endpoint", "status", "replica"),
        )
        self.ttft = Labelled(
            Histogram(
                "kvrouter_router_ttft_seconds",
                "Time from dispatch to the first upstream chunk of streamed requests",
                ("replica",),
                registry=registry,
                buckets=LATENCY_BUCKETS,
            )
        )
        self.duration = Labelled(
            Histogram(
                "kvrouter_router_request_duration_seconds",
                "End-to-end request time as seen by the router",
                ("endpoint",),
                registry=registry,
                buckets=LATENCY_BUCKETS,
            )
        )
        self.decision = Labelled(
            Histogram(
                "kvrouter_router_decision_seconds",
                "Routing decision overhead by stage (tokenize, hash, lookup, score, total)",
                ("stage",),
                registry=registry,
                buckets=STAGE_BUCKETS,
            )
        )
        self.predicted_hit_ratio = Histogram(
            "kvrouter_router_predicted_hit_ratio",
            "Share of each routed prompt predicted to be cached on the chosen replica",
            registry=registry,
            buckets=RATIO_BUCKETS,
        )
        self.return_gap = Histogram(
            "kvrouter_router_return_gap_seconds",
            "Time from a request's finish to the arrival of the request continuing its prompt",
            registry=registry,
            buckets=RETURN_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens routed", ("replica",))
        self.predicted_cached = counter(
            "predicted_cached_tokens",
            "Cached tokens the router predicted on the chosen replica (requests with usage)",
            ("replica",),
        )
        self.engine_cached = counter(
            "engine_cached_tokens",
            "Cached tokens engines reported in usage.prompt_tokens_details.cached_tokens",
            ("replica",),
        )
        self.cache_predictions = counter(
            "cache_predictions",
            "Router prediction vs engine report per request: agree, over, under",
            ("outcome",),
        )
        self.hash_mismatch = Labelled(
            gauge(
                "hash_mismatch",
                "1 while engines keep reporting prefix hits the router predicted none of",
                ("model",),
                workers="livemax",
            )
        )
        self.fallbacks = counter(
            "fallbacks", "Decisions made without the index or without shared load", ("reason",)
        )
        self.retries = counter("retries", "Requests retried on the next-best replica", ("reason",))
        self.sessions = counter(
            "session_requests",
            "Requests naming a session (prompt_cache_key or the session header), by where they "
            "went: new (no live home), home, moved",
            ("outcome",),
        )
        self.shed = Counter(
            "kvrouter_router_shed",
            "Requests refused with 429: every candidate was full",
            registry=registry,
        )
        self.epp_streams = gauge(
            "epp_streams", "Open ext_proc streams (requests through the gateway)", workers="livesum"
        )
        self.epp_reroutes = counter(
            "epp_reroutes",
            "Requests a gateway served on another endpoint than the pick (its retries)",
            ("replica",),
        )
        self.upstream_errors = counter(
            "upstream_errors", "Failed upstream attempts", ("replica", "kind")
        )
        self.stream_errors = counter(
            "stream_errors", "Streams that broke after their first byte", ("replica",)
        )
        self.disconnects = counter(
            "client_disconnects", "Requests whose client left before the end", ("endpoint",)
        )
        self.inflight = Labelled(
            gauge(
                "inflight_requests",
                "Requests in flight per replica",
                ("replica",),
                workers="livesum",
            )
        )
        self.predictions = counter("predictions", "Predict-on-route index writes", ("status",))
        self.breaker_open = gauge(
            "index_breaker_open", "1 while the index circuit breaker is open", workers="livemax"
        )
        self.loop_lag = gauge(
            "event_loop_lag_seconds",
            "How late the event loop ran a timer, the most over the last second",
            workers="livemax",
        )
        self.replica_healthy = Labelled(
            gauge("replica_healthy", "1 while in rotation", ("replica",), workers="livemin")
        )
        self.health_checks = counter("health_checks", "Active health checks", ("result",))
        self.shared_errors = counter(
            "shared_state_errors",
            "Failed background writes and reads of what routers share through Redis: "
            "load_push, load_read, route_write, route_read",
            ("what",),
        )

    def shared_error(self, what: str) -> None:
        """A background write or read of the shared state failed (``what``: see above)."""
        self.shared_errors.labels(what).inc()

    def forget_replica(self, replica: str) -> None:
        """Drop the per-replica gauges of a replica that left."""
        for gauge in (self.inflight, self.replica_healthy):
            with contextlib.suppress(KeyError):
                gauge.remove(replica)


class MismatchDetector:
    """Per model, the last ``window`` requests the engine reported a prefix hit for.

    When at least ``ratio`` of them had no cached tokens the engines' events confirmed, the
    model is flagged (gauge 1, warning every minute); the flag clears below half of that.
    """

    def __init__(self, metrics: RouterMetrics, *, window: int, ratio: float) -> None:
        self.metrics = metrics
        self.window = window
        self.ratio = ratio
        self._recent: dict[str, deque[bool]] = {}
        self._flagged: dict[str, float] = {}

    def flagged(self, model: str) -> bool:
        return model in self._flagged

    def observe(
        self, model: str, replica: str, *, predicted: int, confirmed: int, engine: int, block: int
    ) -> None:
        """One response: ``predicted`` cached tokens vs the ``engine``'s report.

        :param confirmed: the part of ``predicted`` the engines' events placed there (the
            rest only extends the match with the router's own predictions, which would hide
            a mismatch: the router's wrong keys would keep matching themselves).
        """
        metrics = self.metrics
        metrics.predicted_cached.labels(replica).inc(predicted)
        metrics.engine_cached.labels(replica).inc(engine)
        outcome = "agree" if predicted == engine else "over" if predicted > engine else "under"
        metrics.cache_predictions.labels(outcome).inc()
        if engine < block:
            return
        recent = self._recent.get(model)
        if recent is None:
            recent = self._recent[model] = deque(maxlen=self.window)
        recent.append(confirmed == 0)
        if len(recent) < self.window:
            return
        missed = sum(recent) / len(recent)
        now = time.monotonic()
        if missed >= self.ratio:
            last = self._flagged.get(model)
            if last is None or now - last >= WARN_EVERY_S:
                self._flagged[model] = now
                metrics.hash_mismatch.labels(model).set(1)
                logger.warning(
                    "engines report prefix-cache hits the index never placed there: the "
                    "router's block keys differ from the engines' (check block size, model "
                    "name, tokenizer and chat template) or the index misses their events",
                    extra={"model": model, "missed": f"{missed:.0%}", "window": len(recent)},
                )
        elif missed < self.ratio / 2 and model in self._flagged:
            del self._flagged[model]
            metrics.hash_mismatch.labels(model).set(0)
            logger.info("router predictions match engine cache hits again", extra={"model": model})
