"""A service's life in its process: run it until SIGINT or SIGTERM asks it to stop."""

from __future__ import annotations

import asyncio
import signal
from typing import Protocol


class Service(Protocol):
    """What every kvrouter process runs (the tracker, the router)."""

    def request_stop(self) -> None:
        """Begin a graceful shutdown; must be safe to call from a signal handler."""

    async def run(self) -> int:
        """Start, serve until asked to stop, shut down; returns the exit status."""
        ...


async def run_until_signalled(service: Service) -> int:
    """Run ``service`` with SIGINT/SIGTERM wired to :meth:`Service.request_stop`."""
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, service.request_stop)
    try:
        return await service.run()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
