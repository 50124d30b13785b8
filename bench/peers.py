"""The real peer routers as benchmark arms: vllm-router (kv_aware, cache_aware), SGLang's smg
(0.3.2 from sglang-router, and 1.13 in its own virtualenv) and NVIDIA Dynamo's KV router
(:mod:`bench.dynamo`, in a virtualenv of its own).

Each arm is the peer's own binary (``pip install -e '.[peers]'``; smg 1.13:
``scripts/install-smg``, whose ``bin/smg`` would clash with sglang-router's), started as its own
process(es) on the ports kvrouter's routers use, in front of the same simulated engines, so
that the client (and haproxy, with several instances) reach it exactly as they reach
kvrouter; a peer that is not installed is reported and skipped (:func:`missing`). What each
needs: docs/benchmarks.md, "The real peers".
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench.dynamo.arm import DYNAMO, DynamoArm, dynamo_python
from tracker.framework.settings import comma_list

ROOT: Final = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Worker:
    """One engine as a peer sees it: its HTTP URL and (for kv_aware) its event endpoints."""

    url: str
    events: str
    replay: str | None


@dataclass(frozen=True, slots=True)
class PeerArm:
    """How to start one peer router instance.

    :param binary: console script name (found next to this interpreter, else on PATH), or
        its path relative to the repository's root (a peer in a virtualenv of its own).
    :param ready_path: answers 200 once the instance routes (``/readiness`` for smg).
    :param flags: smg only: what it runs with beyond the flags that start it on its ports
        and make it ready within a second.
    """

    name: str
    binary: str
    policy: str
    ready_path: str
    package: str
    events: bool = False
    flags: tuple[str, ...] = ()

    def argv(
        self,
        executable: str,
        *,
        port: int,
        metrics_port: int,
        workers: Sequence[Worker],
        block_size: int,
        model: str,
    ) -> list[str]:
        """The command line of one instance listening on ``127.0.0.1:port``."""
        urls = [w.url for w in workers]
        if Path(self.binary).name == "smg":
            return [
                executable,
                "launch",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                *urls,
                "--policy",
                self.policy,
                "--prometheus-port",
                str(metrics_port),
                "--worker-startup-check-interval",
                "1",
                *self.flags,
                "--log-level",
                "warn",
            ]
        argv = [
            executable,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *urls,
            "--policy",
            self.policy,
            "--prometheus-port",
            str(metrics_port),
            "--worker-startup-check-interval",
            "1",
            "--health-check-interval-secs",
            "1",
            "--log-level",
            "warning",
        ]
        if self.events:
            for worker in workers:
                argv += ["--kv-event-source", f"{worker.url}={worker.events}"]
                if worker.replay is not None:
                    argv += ["--kv-event-replay-source", f"{worker.url}={worker.replay}"]
            argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        return argv


PEERS: Final[dict[str, PeerArm | DynamoArm]] = {
    arm.name: arm
    for arm in (
        PeerArm("vllm-kv", "vllm-router", "kv_aware", "/health", "vllm-router", events=True),
        PeerArm("vllm-cache", "vllm-router", "cache_aware", "/health", "vllm-router"),
        PeerArm(
            "smg",
            "smg",
            "cache_aware",
            "/readiness",
            "sglang-router",
            flags=("--health-check-interval-secs", "1"),
        ),
        # at its defaults, as users run it: engine /metrics scraped every 10 s, an engine
        # with 8 waiting requests or 80 % KV usage skipped, a 60 s warm-up (docs/benchmarks.md)
        PeerArm(
            "smg13",
            ".peers/smg13/bin/smg",
            "cache_aware",
            "/readiness",
            "smg==1.13.0",
            flags=("--prometheus-host", "127.0.0.1"),
        ),
        DYNAMO,
    )
}
INSTALL_HINT: Final = (
    "pip install -e '.[peers]' (vllm-router==0.1.17, sglang-router==0.3.2); "
    "scripts/install-smg (smg==1.13.0 in .peers/smg13)"
)


def install_hint(name: str) -> str:
    """How to install peer arm ``name``."""
    arm = PEERS[name]
    return arm.install if isinstance(arm, DynamoArm) else INSTALL_HINT


def _installed(arm: PeerArm | DynamoArm) -> bool:
    return (
        dynamo_python() is not None if isinstance(arm, DynamoArm) else bool(executable(arm.binary))
    )


def executable(binary: str) -> str | None:
    """The peer's console script: beside this interpreter (its venv) first, then on PATH; a
    ``binary`` with a ``/`` is a path below the repository's root, and only there."""
    if "/" in binary:
        own = ROOT / binary
        return str(own) if own.exists() else None
    beside = Path(sys.executable).parent / binary
    if beside.exists():
        return str(beside)
    return shutil.which(binary)


def missing(arms: Sequence[str]) -> dict[str, str]:
    """The peer arms among ``arms`` whose binary is not installed, with the package to install."""
    return {
        name: PEERS[name].package for name in arms if name in PEERS and not _installed(PEERS[name])
    }


def named(spec: str) -> list[str]:
    """The peer arms a comma-separated ``spec`` names (``''``: none).

    :raises ValueError: ``spec`` names an arm that does not exist.
    """
    names = list(comma_list(spec, str))
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise ValueError(f"unknown peers: {', '.join(unknown)} (known: {', '.join(PEERS)})")
    return names


def installed(spec: str) -> list[str]:
    """The peer arms a comma-separated ``spec`` names that are installed; each one that is
    not is reported on stderr and skipped.

    :raises ValueError: ``spec`` names an arm that does not exist.
    """
    names = named(spec)
    absent = missing(names)
    for name, package in absent.items():
        print(
            f"{name}: skipped, {package} is not installed ({install_hint(name)})", file=sys.stderr
        )
    return [name for name in names if name not in absent]
