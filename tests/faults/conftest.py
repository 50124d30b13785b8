"""Fixtures of the fault drills: a fresh local stack per drill, stopped however the drill ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.stack.local import LocalStack
from tests.faults.drill import Drill, drill_config

DrillFactory = Callable[..., Awaitable[Drill]]


@pytest.fixture
async def drill_factory(tmp_path: Path) -> AsyncIterator[DrillFactory]:
    """``await start(router_args=..., time_scale=...)``: a started, warmed-up stack."""
    drills: list[Drill] = []

    async def start(*, router_args: Sequence[str] = (), **config: Any) -> Drill:
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
