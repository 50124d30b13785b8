"""What the dynamo arm's adapter hop costs a lone request, against Dynamo with its own worker.

The arm reaches the simulated engines through an adapter (:mod:`bench.dynamo.adapter`): the
frontend's request plane to the adapter, then HTTP to the engine. A deployment of Dynamo's
own mocker worker (``python -m dynamo.mocker --speedup-ratio 0``: no simulated time, no HTTP,
no adapter) behind a frontend of its own is Dynamo alone. Round after round, the same kind of
request (a group's cached system prompt and a new question, :func:`bench.overhead.measure`)
goes straight to an engine, through kvrouter, through the dynamo arm and through Dynamo alone,
with the engines at a time scale where prefill is near zero. The arm's paired difference over
the direct request is what it adds; ``dynamo`` over ``dynamo-mocker`` is the adapter hop plus
the engine's own time to first token (the direct request's, less the client's HTTP).

    python -m bench.dynamo.hop [--rounds 200] [--json FILE]
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench.dynamo.arm import (
    DYNAMO,
    dynamo_python,
    env_prefix,
    frontend_argv,
    wait_ready,
)
from bench.dynamo.model import write_model_dir
from bench.overhead import PROMPT_TOKENS, engine_blocks, measure, render
from bench.proxy_load import router_part
from bench.stack.config import StackConfig
from bench.stack.local import LocalStack
from bench.stack.ports import free_ports
from tracker.framework.cli import parse_argv
from tracker.framework.settings import Settings, setting

ARM: Final = "dynamo"
ALONE: Final = "dynamo-mocker"
GROUPS: Final = 10


def pids_of(stack: LocalStack, names: Sequence[str]) -> list[int]:
    """The running processes among ``names``."""
    return [pid for name in names if (pid := stack.processes.pid(name)) is not None]


def start_mocker(stack: LocalStack, port: int, workers: int) -> list[str]:
    """Dynamo alone: ``workers`` mocker workers (no simulated time) and a frontend on
    ``port``, in a discovery directory of their own; the frontend's process name first."""
    python = dynamo_python()
    assert python is not None  # checked by the caller
    cfg = stack.config
    root = Path(tempfile.mkdtemp(prefix="dynamo-mocker-", dir=stack.workdir))
    model = write_model_dir(root / "model", context_length=cfg.num_blocks * cfg.block_size)
    prefix = env_prefix(root)
    names = []
    for i in range(workers):
        name = f"{ALONE}-worker-{i}"
        argv = [
            *prefix, python, "-m", "dynamo.mocker", "--model-path", str(model),
            "--model-name", cfg.model, "--endpoint", "dyn://mocker.backend.generate",
            "--block-size", str(cfg.block_size), "--num-gpu-blocks-override",
            str(cfg.num_blocks), "--speedup-ratio", "0", "--discovery-backend", "file",
            "--request-plane", "tcp", "--event-plane", "zmq",
        ]  # fmt: skip
        stack.processes.spawn(name, argv, None)
        names.append(name)
    stack.processes.spawn(ALONE, [*prefix, *frontend_argv(python, port, sync=False)], None)
    wait_ready(stack, [(ALONE, port)], [ALONE, *names], workers, DYNAMO.ready_timeout_s)
    return [ALONE, *names]


@dataclass(frozen=True, kw_only=True)
class HopSettings(Settings):
    """``python -m bench.dynamo.hop``: rounds and the engines' time scale."""

    PART = "DYNAMO_HOP"

    rounds: int = setting(200, "requests per target")
    time_scale: float = setting(0.001, "engines' time scale")
    json: str | None = setting(None, "write the report here too")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_argv(HopSettings, argv, prog="python -m bench.dynamo.hop", description=__doc__)
    if dynamo_python() is None:
        print(f"{ARM}: {DYNAMO.package} is not installed ({DYNAMO.install})")
        return 1
    config = StackConfig(
        replicas=2,
        routers=1,
        haproxy=False,
        time_scale=args.time_scale,
        num_blocks=engine_blocks(GROUPS, PROMPT_TOKENS, StackConfig.block_size),
        replica_args=("--replay-layout", "topic"),
    )
    with LocalStack(config).start() as stack:
        arm_port = free_ports(2)
        alone_port = arm_port + 1
        arm = DYNAMO.start(stack, [(ARM, arm_port)])
        alone = start_mocker(stack, alone_port, workers=config.replicas)
        targets = {
            "kvrouter": stack.layout.router_urls[0],
            ARM: f"http://127.0.0.1:{arm_port}",
            ALONE: f"http://127.0.0.1:{alone_port}",
        }
        pids: dict[str, dict[str, list[int]]] = {
            "kvrouter": router_part(stack.processes.pid("router-0")),
            # each Dynamo's frontend and its workers (the adapters, the mockers) apart
            ARM: {"frontend": pids_of(stack, arm[:1]), "adapter": pids_of(stack, arm[1:])},
            ALONE: {"frontend": pids_of(stack, alone[:1]), "mocker": pids_of(stack, alone[1:])},
        }
        report = asyncio.run(
            measure(
                targets,
                stack.layout.replica_urls,
                rounds=args.rounds,
                groups=GROUPS,
                seed=1,
                pids=pids,
                baselines={ARM: ALONE},
            )
        )
    print(render(report))
    if args.json:
        meta = {"rounds": args.rounds, "time_scale": args.time_scale}
        Path(args.json).write_text(json.dumps({**meta, "targets": report}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
