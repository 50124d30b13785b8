"""The router's subcommand, registered under the ``kvrouter.commands`` entry point group."""

from __future__ import annotations

from router.config import EppSettings, RouterSettings
from tracker.framework.cli import Command


def _run_router(settings: RouterSettings) -> int:
    """One router in this process, or ``--workers N`` router processes on one socket."""
    from router.workers import WorkerPool, worker_count  # noqa: PLC0415 - keep `--help` light

    count = worker_count(settings)
    if count > 1:
        return WorkerPool(settings, count).run()
    from router.service import run  # noqa: PLC0415

    return run(settings)


ROUTER = Command(
    "router",
    "serve the KV-cache-aware OpenAI-compatible router in front of the replicas",
    RouterSettings,
    _run_router,
)


def _run_epp(settings: EppSettings) -> int:
    from router.epp.service import run  # noqa: PLC0415 - keep `--help` light

    return run(settings)


EPP = Command(
    "epp",
    "serve kvrouter's decisions as a Gateway API Inference Extension endpoint picker "
    "(Envoy ext_proc gRPC): the gateway carries the bytes",
    EppSettings,
    _run_epp,
)
