"""The ``dynamo`` arm: NVIDIA Dynamo 1.6.1's frontend and KV router in front of the fleet.

Dynamo routes only among workers registered with it, so the arm is three kinds of process,
all in Dynamo's own virtualenv (``scripts/install-dynamo``) and sharing one fresh discovery
directory (``DYN_FILE_KV``; no etcd, no NATS) per start: one adapter per engine
(:mod:`bench.dynamo.adapter`, started first so that it hears the engine's first KV event),
then one ``python -m dynamo.frontend --router-mode kv`` per router port, with
``--router-replica-sync`` when there are several. The frontends tokenize from a model
directory exported from the engines' tokenizer (:mod:`bench.dynamo.model`). Ready when every
frontend lists every engine's ``generate`` instance (its ``/health`` answers 200 with none).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import httpx

from bench.dynamo.model import write_model_dir
from bench.stack.processes import StackError

if TYPE_CHECKING:
    from bench.stack.local import LocalStack

VENV_ENV: Final = "KVROUTER_DYNAMO_VENV"
"""Names Dynamo's virtualenv when it is not ``.peers/dynamo`` in the checkout."""
DEFAULT_VENV: Final = Path(__file__).resolve().parents[2] / ".peers" / "dynamo"
ADAPTER: Final = Path(__file__).resolve().with_name("adapter.py")
# every Dynamo process on loopback, logging warnings only (as the other peers run), and never
# asking the Hugging Face hub for anything (the model directory is local)
_ENV: Final = {
    "DYN_LOG": "warn",
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_SELF_HOST_METADATA": "0",
    "HF_HUB_OFFLINE": "1",
}


def dynamo_python(environ: Mapping[str, str] = os.environ) -> str | None:
    """The interpreter of Dynamo's virtualenv (``$KVROUTER_DYNAMO_VENV``, else
    ``.peers/dynamo``) if Dynamo's frontend is installed there."""
    venv = Path(environ.get(VENV_ENV) or DEFAULT_VENV)
    python = venv / "bin" / "python"
    frontend = venv.glob("lib/python*/site-packages/dynamo/frontend/__main__.py")
    return str(python) if python.exists() and next(frontend, None) else None


def env_prefix(discovery: Path) -> list[str]:
    """``env VAR=value ...``: a Dynamo process's environment, sharing ``discovery``.

    :raises StackError: there is no ``env`` to run.
    """
    env = shutil.which("env")
    if env is None:
        raise StackError("the dynamo arm needs env(1) on PATH")
    return [env, *(f"{k}={v}" for k, v in {**_ENV, "DYN_FILE_KV": str(discovery)}.items())]


def frontend_argv(python: str, port: int, *, sync: bool) -> list[str]:
    """Dynamo's frontend with its KV router on ``127.0.0.1:port``, file discovery, TCP
    requests and ZMQ events (no etcd, no NATS); ``sync``: share load with other replicas."""
    return [
        python, "-m", "dynamo.frontend", "--discovery-backend", "file", "--request-plane", "tcp",
        "--event-plane", "zmq", "--router-mode", "kv", "--http-host", "127.0.0.1",
        "--http-port", str(port), *(["--router-replica-sync"] if sync else []),
    ]  # fmt: skip


def generate_instances(health: dict[str, Any]) -> int:
    """A frontend's ``/health``: the workers' ``generate`` instances it routes to."""
    return sum(1 for instance in health["instances"] if instance["endpoint"] == "generate")


@dataclass(frozen=True, slots=True)
class DynamoArm:
    """How to start the Dynamo arm in front of a :class:`~bench.stack.local.LocalStack`.

    :param ready_timeout_s: for every frontend to list every engine.
    """

    name: str = "dynamo"
    package: str = "ai-dynamo==1.6.1"
    install: str = "scripts/install-dynamo"
    ready_timeout_s: float = 60.0

    def start(self, stack: LocalStack, frontends: Sequence[tuple[str, int]]) -> list[str]:
        """Adapters for the stack's engines, then a frontend per ``(process name, port)``,
        started under the stack's control and waited for; every process name, frontends
        first (the order to stop them in).

        :raises StackError: Dynamo is not installed, or a process exits or is not ready.
        """
        python = dynamo_python()
        if python is None:
            raise StackError(f"{self.name}: {self.package} is not installed ({self.install})")
        cfg = stack.config
        root = Path(tempfile.mkdtemp(prefix="dynamo-", dir=stack.workdir))
        if cfg.vllm is not None:
            model_dir = Path(cfg.vllm.model)
            context_length = cfg.vllm.max_model_len
        else:
            context_length = cfg.num_blocks * cfg.block_size  # the engines' default
            model_dir = write_model_dir(root / "model", context_length=context_length)
        prefix = env_prefix(root)
        adapters = []
        for i, (url, events, _) in enumerate(stack.layout.endpoints()):
            name = f"{self.name}-adapter-{i}"
            argv = [
                *prefix, python, str(ADAPTER), "--engine", url, "--events", events,
                "--model", cfg.model, "--model-dir", str(model_dir),
                "--block-size", str(cfg.block_size), "--num-blocks", str(cfg.num_blocks),
                "--max-num-seqs", str(cfg.max_num_seqs),
                "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                "--context-length", str(context_length),
            ]  # fmt: skip
            stack.processes.spawn(name, argv, None)
            adapters.append(name)
        for name, port in frontends:
            argv = frontend_argv(python, port, sync=len(frontends) > 1)
            stack.processes.spawn(name, [*prefix, *argv], None)
        names = [*(name for name, _ in frontends), *adapters]
        wait_ready(stack, frontends, names, len(adapters), self.ready_timeout_s)
        return names


def wait_ready(
    stack: LocalStack,
    frontends: Sequence[tuple[str, int]],
    names: Sequence[str],
    workers: int,
    timeout_s: float,
) -> None:
    """Until each frontend lists ``workers`` ``generate`` instances, while every process
    ``names`` of the deployment runs.

    :raises StackError: one exited, or a frontend lists fewer after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    for name, port in frontends:
        seen = -1
        while seen < workers:
            for each in names:
                stack.processes.check_alive(each)
            if time.monotonic() > deadline:
                raise StackError(f"{name} lists {seen} of {workers} Dynamo workers")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                seen = generate_instances(health.json())
            if seen < workers:
                time.sleep(0.1)


DYNAMO: Final = DynamoArm()
