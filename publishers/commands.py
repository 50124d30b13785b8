"""The publishers' commands: ``kvrouter replica`` and ``kvrouter attach``.

Registered under the ``kvrouter.commands`` entry point group; the heavy modules are imported
only when a command runs, so ``kvrouter --help`` stays fast. Their settings live in
:mod:`publishers.config`.
"""

from __future__ import annotations

from publishers.config import AttachSettings, ReplicaSettings
from tracker.framework.cli import Command


def _run_replica(settings: ReplicaSettings) -> int:
    from publishers.sim.fleet import run  # noqa: PLC0415 - keep `kvrouter --help` light

    return run(settings)


def _run_attach(settings: AttachSettings) -> int:
    from publishers.vllm import run  # noqa: PLC0415

    return run(settings)


REPLICA = Command(
    "replica",
    "run simulated vLLM engines: OpenAI server, KV events, registry heartbeats",
    ReplicaSettings,
    _run_replica,
)
ATTACH = Command(
    "attach",
    "register a real vLLM server in the registry while its /health answers",
    AttachSettings,
    _run_attach,
)
