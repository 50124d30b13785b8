"""vLLM's Prometheus metrics, by vLLM's names and labels, for the simulated engine's server.

Engine-level values (queue lengths, cache usage, prefix-cache counters) are read from
``engine.stats()`` at scrape time; request-level ones (TTFT, successes, token counts) are
recorded by the server as requests finish. Labels are vLLM v1's ``model_name`` and
``engine`` (the data-parallel index), plus ``finished_reason`` on successes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LABELS: Final = ("model_name", "engine")
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# (vLLM name, help, EngineStats attribute); counters get ``_total`` on the wire
GAUGES: Final = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.",
     "num_requests_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
     "num_requests_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     "kv_cache_usage_perc"),
)  # fmt: skip
COUNTERS: Final = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
     "num_preemptions"),
)  # fmt: skip


class _EngineStatsCollector(Collector):
    """Reads the engine's counters and gauges when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], Any], labels: tuple[str, str]) -> None:
        self._stats = stats
        self._labels = list(labels)

    def describe(self) -> Iterable[Metric]:
        yield from self._families(None)

    def collect(self) -> Iterable[Metric]:
        yield from self._families(self._stats())

    def _families(self, stats: Any) -> Iterator[Metric]:
        for name, doc, attr in GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            if stats is not None:
                gauge.add_metric(self._labels, float(getattr(stats, attr)))
            yield gauge
        for name, doc, attr in COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            if stats is not None:
                counter.add_metric(self._labels, float(getattr(stats, attr)))
            yield counter


class ServerMetrics:
    """The simulated server's metrics on ``registry``, labelled for one model and engine."""

    def __init__(
        self,
        registry: CollectorRegistry,
        stats: Callable[[], Any],
        *,
        model: str,
        engine_index: int = 0,
        cache_config: dict[str, str] | None = None,
    ) -> None:
        """:param cache_config: labels of ``vllm:cache_config_info`` (``num_gpu_blocks``...)."""
        labels = (model, str(engine_index))
        registry.register(_EngineStatsCollector(stats, labels))
        self._labels = labels
        if cache_config is not None:
            info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                [*LABELS, *cache_config],
                registry=registry,
            )
            info.labels(*labels, *cache_config.values()).set(1)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            registry=registry,
            buckets=TTFT_BUCKETS,
        ).labels(*labels)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            registry=registry,
            buckets=LATENCY_BUCKETS,
        ).labels(*labels)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=registry
        ).labels(*labels)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            LABELS,
            registry=registry,
        ).labels(*labels)

    def finished(
        self, reason: str | None, prompt_tokens: int, completion_tokens: int, e2e_s: float
    ) -> None:
        """Record a request that ran to completion (aborted ones count only their tokens)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if reason in ("stop", "length"):
            self._success.labels(*self._labels, reason).inc()
            self.e2e.observe(e2e_s)
