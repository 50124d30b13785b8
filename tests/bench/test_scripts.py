"""The ``python -m bench.X`` scripts' command lines: flags generated from their settings, and
the invocations README.md and the docs give."""

from __future__ import annotations

from typing import Any

import pytest

from bench.client_cost import ClientCostSettings
from bench.index_bench import IndexBenchSettings
from bench.overhead import OverheadSettings
from bench.report import ReportSettings
from bench.router_bench import RouterBenchSettings
from bench.saturation import SaturationSettings
from bench.stack.config import StackSettings
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings


@pytest.mark.parametrize(
    ("settings", "argv", "expected"),
    [
        (IndexBenchSettings, [], {"replicas": 8, "json": "bench/results/index.json"}),
        (RouterBenchSettings, ["--skip-decision"], {"skip_decision": True, "quick": False}),
        (
            RouterBenchSettings,
            ["--quick"],
            {"quick": True, "size_list": [1000, 8000, 32000, 100000]},
        ),
        (ClientCostSettings, [], {"requests": 2000, "concurrency": 32, "rounds": 2}),
        (
            OverheadSettings,
            ["--rounds", "400", "--json", "bench/results/overhead.json"],
            {"rounds": 400, "time_scale": 0.001, "embedded": True},
        ),
        (
            SaturationSettings,
            ["--rates", "100,200,400,600", "--json", "bench/results/saturation.json"],
            {"levels": (1, 8, 32, 128), "rate_levels": (100.0, 200.0, 400.0, 600.0)},
        ),
        (
            SaturationSettings,
            [
                *("--concurrency", "", "--rates", "100,200,400", "--seconds", "12"),
                *("--rounds", "4", "--workers", "1", "--no-local-index"),
            ],
            {"levels": (), "seconds": 12.0, "worker_counts": (1,), "local_index": False},
        ),
        (
            SaturationSettings,
            [
                *("--concurrency", "32,128,256", "--workers", "1,2", "--no-local-index"),
                *("--no-embedded", "--epp", "1,2", "--json", "x.json"),
            ],
            {"levels": (32, 128, 256), "picker_counts": (1, 2), "epp_headers": True},
        ),
        (
            OverheadSettings,
            ["--rounds", "200", "--prompt-tokens", "8000", "--json", "x.json"],
            {"prompt_tokens": 8000, "picker_counts": (1,), "envoy": True},
        ),
        (StackSettings, ["--time-scale", "0.1"], {"time_scale": 0.1, "redis": True}),
        (
            ReportSettings,
            ["bench/results/routing-gsp.json"],
            {"result": "bench/results/routing-gsp.json"},
        ),
    ],
)
def test_documented_invocations_parse(
    settings: type[Settings], argv: list[str], expected: dict[str, Any]
) -> None:
    parsed = parse_argv(settings, argv)
    assert {name: getattr(parsed, name) for name in expected} == expected


def test_the_stack_without_redis_is_one_embedded_router() -> None:
    config = parse_argv(StackSettings, ["--no-redis", "--no-haproxy"]).config()
    assert (config.redis, config.routers, config.haproxy) == (False, 1, False)


@pytest.mark.parametrize(
    ("settings", "argv"),
    [
        (OverheadSettings, ["--peers", "nginx"]),
        (OverheadSettings, ["--prompt-tokens", "100"]),
        (OverheadSettings, ["--epp", "0"]),
        (SaturationSettings, ["--epp", "0"]),
        (RouterBenchSettings, ["--sizes", "1,x"]),
        (IndexBenchSettings, ["--replicas", "many"]),
        (ReportSettings, []),  # the result document is required
    ],
)
def test_bad_command_lines_are_usage_errors(settings: type[Settings], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_argv(settings, argv)
    assert exc.value.code == 2
