"""A service's life in its process: run it until SIGINT or SIGTERM asks it to stop."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable, Collection, Coroutine
from typing import Any, Final, Protocol, TypeVar

from tracker.framework.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")
LOOPS: Final = ("auto", "uvloop", "asyncio")
CANCEL_ROUNDS: Final = 10


class Service(Protocol):
    """What every kvrouter process runs (the tracker, the router)."""

    def request_stop(self) -> None:
        """Begin a graceful shutdown; must be safe to call from a signal handler."""

    async def run(self) -> int:
        """Start, serve until asked to stop, shut down; returns the exit status."""
        ...


def freeze_heap() -> None:
    """Collect once, then move every object alive now out of the garbage collector's reach.

    A process's start-up heap (modules, settings, the tokenizer, the app) lives until it
    exits, yet every full collection walks it again: on the router a full collection took
    44-52 ms, a stall that every request in flight waits out, and 1.7 ms once that heap was
    frozen (docs/benchmarks.md). vLLM freezes its engine's start-up heap the same way.
    Call it once a service has started; objects frozen are still freed by reference counting.
    """
    gc.collect()
    gc.freeze()


async def cancel_and_wait(tasks: Collection[asyncio.Task[Any]], *, grace_s: float = 1.0) -> None:
    """Cancel background ``tasks`` and wait until they have ended, cancelling again any that
    is still running after ``grace_s``: a library may swallow a cancellation (with redis-py
    8.1 on Python 3.11, a registry read cancelled while Redis restarted returned its answer
    instead, and its loop ran on: the router hung at shutdown in 1 of ~10 runs of
    tests/router/test_failover.py). Gives up, logging what is left, after a few rounds; the
    event loop's own shutdown cancels those."""
    pending = {task for task in tasks if not task.done()}
    for _ in range(CANCEL_ROUNDS):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    else:
        if pending:
            names = ", ".join(sorted(task.get_name() for task in pending))
            logger.error("background tasks ignored cancellation", extra={"tasks": names})
    # retrieve every outcome, so that none is reported as never retrieved
    await asyncio.gather(*(task for task in tasks if task.done()), return_exceptions=True)


async def finish_or_cancel(
    tasks: Collection[asyncio.Task[Any]], timeout_s: float
) -> tuple[int, int]:
    """Let ``tasks`` end on their own for up to ``timeout_s``, then :func:`cancel_and_wait`
    the rest (every outcome is retrieved); returns how many ended on their own and how many
    were cancelled."""
    if not tasks:
        return 0, 0
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, timeout_s))
    await cancel_and_wait(tasks)
    return len(done), len(pending)


async def serve_until(stopping: asyncio.Event, serving: asyncio.Task[None]) -> bool:
    """Wait until a stop is requested (``stopping`` set) or the server ends on its own;
    True in the second case, which is a failure."""
    stop = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({stop, serving}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    return serving.done() and not stopping.is_set()


async def run_until_signalled(
    service: Service, *, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
) -> int:
    """Run ``service`` with ``signals`` wired to :meth:`Service.request_stop`."""
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, service.request_stop)
    try:
        return await service.run()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a process runs on: uvloop for ``uvloop`` (and for ``auto`` when it is
    installed, as uvicorn chooses), asyncio's own for ``asyncio``; None means asyncio's.

    :raises ConfigError: for an unknown name, or ``uvloop`` when it is not installed.
    """
    if loop not in LOOPS:
        raise ConfigError(f"loop: must be one of {', '.join(LOOPS)}, got {loop!r}")
    if loop == "asyncio":
        return None
    try:
        import uvloop  # noqa: PLC0415 - optional, like uvicorn's
    except ImportError:
        if loop == "uvloop":
            raise ConfigError("loop: uvloop asked for, but it is not installed") from None
        return None
    return uvloop.new_event_loop


def running_loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: which loop runs this process (for its start-up log)."""
    return type(asyncio.get_running_loop()).__module__.partition(".")[0]


def run_on_loop(main: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks."""
    try:
        factory = loop_factory(loop)
    except ConfigError:
        main.close()  # never to be awaited
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
