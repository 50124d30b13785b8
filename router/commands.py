"""The router's subcommand, registered under the ``kvrouter.commands`` entry point group."""

from __future__ import annotations

from router.config import RouterSettings
from tracker.cli import Command


def _run_router(settings: RouterSettings) -> int:
    from router.service import run  # noqa: PLC0415 - keep `kvrouter --help` light

    return run(settings)


ROUTER = Command(
    "router",
    "serve the KV-cache-aware OpenAI-compatible router in front of the replicas",
    RouterSettings,
    _run_router,
)
