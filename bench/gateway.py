"""The gateway arms of the benchmarks: a real Envoy in front of a stack's engines, asking
``kvrouter epp`` pickers where each request goes (Envoy carries the bytes), or alone.

Each arm is its own Envoy and its own pickers, started under the stack's control beside
whatever else it runs (the proxies, the peers), on the stack's Redis and tracker as
``kvrouter router --redis`` uses them. Envoy alone has no ext_proc filter: a request goes
to the engine its ``x-gateway-destination-endpoint`` header names, round robin without one.
The CPU of an arm is read per part: its pickers (``epp``) and Envoy (``envoy``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from bench.stack.config import Gateway
from bench.stack.envoy import MISSING, envoy_argv, envoy_binary
from bench.stack.layout import gateway_envoy, kvrouter_bin, picker_flags
from bench.stack.local import LocalStack
from bench.stack.ports import free_ports

ENVOY: Final = "envoy"
EPP: Final = "envoy+epp"


@dataclass(frozen=True)
class GatewayArm:
    """One Envoy and its pickers.

    :param pickers: ``kvrouter epp`` replicas Envoy asks, round robin (0: Envoy alone).
    :param gateway: how Envoy talks to them (the response body streamed through the picker
        or only its headers shown, TLS).
    """

    name: str
    pickers: int
    gateway: Gateway = field(default_factory=Gateway)


def gateway_arms(
    pickers: Sequence[int], *, headers_only: bool, envoy: bool, tls: bool = True
) -> list[GatewayArm]:
    """The arms: ``envoy+epp`` (one picker; ``-pN`` with N), each again with the response
    body skipped (``-hdr``) when ``headers_only``, and Envoy alone when ``envoy``; none,
    each reported on stderr, when Envoy is not installed."""
    bodies = ((True, ""), (False, "-hdr"))[: 2 if headers_only else 1]
    arms = [
        GatewayArm(f"{EPP}{_pickers(n)}{suffix}", n, Gateway(tls=tls, response_body=body))
        for n in pickers
        for body, suffix in bodies
    ]
    if envoy:
        arms.append(GatewayArm(ENVOY, 0))
    if arms and envoy_binary() is None:
        for arm in arms:
            print(f"{arm.name}: skipped, {MISSING}", file=sys.stderr)
        return []
    return arms


def _pickers(n: int) -> str:
    return "" if n == 1 else f"-p{n}"


def start_gateway(
    stack: LocalStack, arm: GatewayArm, *, extra: Sequence[str] = ()
) -> tuple[str, dict[str, list[int]]]:
    """Start ``arm``'s pickers (processes ``<name>-epp-i``, each serving once it knows every
    engine) and its Envoy (``<name>-envoy``, once ready); Envoy's URL and the arm's pids by
    part (``epp``, ``envoy``).

    :param extra: more ``kvrouter epp`` flags (as the proxy arms get).
    """
    config, layout = stack.config, stack.layout
    assert layout.redis_url is not None, "the pickers share the stack's Redis"
    ports = free_ports(2 + 3 * arm.pickers)
    listen, admin = ports, ports + 1
    epps, pids = [], []
    for i in range(arm.pickers):
        name = f"{arm.name}-epp-{i}"
        http, grpc, health = (ports + 2 + 3 * i + k for k in range(3))
        argv = [
            kvrouter_bin(), "epp", "--port", str(http), "--router-id", name,
            "--model", config.model, "--block-size", str(config.block_size),
            "--redis", layout.redis_url, *picker_flags(arm.gateway, grpc, health), *extra,
        ]  # fmt: skip
        url = f"http://127.0.0.1:{http}/health"
        stack.processes.spawn(name, argv, url)
        stack.wait_knows_replicas(name, url, 30.0)
        epps.append(f"127.0.0.1:{grpc}")
        pids.append(_pid(stack, name))
    envoy = gateway_envoy(
        arm.gateway,
        port=listen,
        admin_port=admin,
        epps=epps,
        engines=[url.removeprefix("http://") for url in layout.replica_urls],
    )
    name = f"{arm.name}-envoy"
    path = envoy.write(stack.workdir / f"{name}.json")
    argv = envoy_argv(path, log_level="warning")
    stack.processes.spawn(name, argv, f"http://127.0.0.1:{admin}/ready")
    parts = {"epp": pids} if pids else {}
    return f"http://127.0.0.1:{listen}", parts | {"envoy": [_pid(stack, name)]}


def _pid(stack: LocalStack, name: str) -> int:
    pid = stack.processes.pid(name)
    assert pid is not None
    return pid
