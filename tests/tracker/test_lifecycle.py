"""A service's process: which event loop it runs on (``--loop``), its start-up heap frozen."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from router.service import RouterService
from tests.router.harness import router_settings
from tracker.core.memory_index import MemoryIndex
from tracker.framework.errors import ConfigError
from tracker.framework.lifecycle import (
    cancel_and_wait,
    finish_or_cancel,
    loop_factory,
    run_on_loop,
    running_loop_name,
)
from tracker.ingest.config import TrackerSettings
from tracker.ingest.service import TrackerService


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


async def _loop_name() -> str:
    return running_loop_name()


def test_asyncio_runs_on_asyncios_own_loop() -> None:
    assert loop_factory("asyncio") is None
    assert run_on_loop(_loop_module(), "asyncio").startswith("asyncio")
    assert run_on_loop(_loop_name(), "asyncio") == "asyncio"


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop not installed")
def test_auto_and_uvloop_run_on_uvloop_when_installed() -> None:
    for name in ("auto", "uvloop"):
        assert run_on_loop(_loop_module(), name).startswith("uvloop")
        assert run_on_loop(_loop_name(), name) == "uvloop"


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_an_unknown_loop_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="loop: must be one of auto, uvloop, asyncio"):
        loop_factory("trio")
    with pytest.raises(ConfigError, match="loop: must be one of"):
        run_on_loop(_loop_module(), "trio")  # and the coroutine is closed, not left unawaited


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Each test starts with nothing frozen, and leaves nothing frozen behind."""
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.mark.usefixtures("unfrozen")
async def test_a_router_that_owns_its_process_freezes_its_start_up_heap() -> None:
    for freeze in (False, True):
        service = RouterService(router_settings(), freeze=freeze)
        await service.start()
        try:
            assert (gc.get_freeze_count() > 0) is freeze
        finally:
            await service.stop()


@pytest.mark.usefixtures("unfrozen")
async def test_a_tracker_that_owns_its_process_freezes_its_start_up_heap() -> None:
    for freeze in (False, True):
        service = TrackerService(
            TrackerSettings(bind="tcp://127.0.0.1:0"),
            MemoryIndex(),
            CollectorRegistry(),
            freeze=freeze,
        )
        await service.start()
        try:
            assert (gc.get_freeze_count() > 0) is freeze
        finally:
            await service.stop()


async def test_cancel_and_wait_ends_a_task_that_swallowed_its_cancellation() -> None:
    """A library that catches CancelledError (and returns) leaves a loop running after one
    cancel: it is cancelled again until it ends."""
    rounds = 0

    async def stubborn() -> None:
        nonlocal rounds
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                rounds += 1
                if rounds == 1:
                    continue  # swallowed, as the library did
                raise

    task = asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    quiet = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    finished = asyncio.get_running_loop().create_task(asyncio.sleep(0))
    await finished
    await cancel_and_wait([task, quiet, finished], grace_s=0.05)
    assert task.cancelled() and quiet.cancelled() and rounds == 2


async def test_cancel_and_wait_gives_up_on_a_task_that_never_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    alive = True

    async def immortal() -> None:
        while alive:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    task = asyncio.get_running_loop().create_task(immortal(), name="immortal")
    await asyncio.sleep(0)
    try:
        await cancel_and_wait([task], grace_s=0.01)
        assert not task.done()
        [record] = [r for r in caplog.records if "ignored cancellation" in r.getMessage()]
        assert record.tasks == "immortal"  # type: ignore[attr-defined]
    finally:
        alive = False
        task.cancel()
        await asyncio.wait([task])


async def test_finish_or_cancel_lets_tasks_end_until_the_timeout_then_cancels_the_rest() -> None:
    loop = asyncio.get_running_loop()
    quick = loop.create_task(asyncio.sleep(0.01))
    slow = loop.create_task(asyncio.sleep(3600))
    assert await finish_or_cancel([quick, slow], 0.2) == (1, 1)
    assert quick.done() and not quick.cancelled() and slow.cancelled()
    assert await finish_or_cancel([], 0.2) == (0, 0)
