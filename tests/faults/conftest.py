"""Fixtures of the fault drills: a fresh local stack per drill, stopped however the drill ends."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from bench.stack import LocalStack
from tests.faults.drill import Drill, drill_config

DrillFactory = Callable[..., Awaitable[Drill]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The drills take ~5 minutes on 2 cores and are still being stabilised (see
    # docs/reliability.md): opt in with KVROUTER_FAULTS=1 (scripts/faults does).
    if os.environ.get("KVROUTER_FAULTS") == "1":
        return
    skip = pytest.mark.skip(reason="fault drills are opt-in: set KVROUTER_FAULTS=1")
    for item in items:
        if "tests/faults/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture
async def drill_factory(tmp_path: Path) -> AsyncIterator[DrillFactory]:
    """``await start(router_args=..., time_scale=...)``: a started, warmed-up stack."""
    drills: list[Drill] = []

    async def start(*, router_args: Sequence[str] = (), **config: float) -> Drill:
        workdir = tmp_path / f"stack-{len(drills)}"
        stack = LocalStack(drill_config(workdir, router_args=router_args, **config))
        await asyncio.to_thread(stack.start, 60.0)
        drill = Drill(stack)
        drills.append(drill)
        await drill.warm_up()
        return drill

    yield start
    for drill in drills:
        await drill.aclose()
        await asyncio.to_thread(drill.stack.stop)
