"""Which event loop a process runs on (``--loop``)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from tracker.errors import ConfigError
from tracker.lifecycle import loop_factory, run_on_loop, running_loop_name


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
