"""What the local stack runs: its shape (:class:`StackConfig`: engines, routers, Redis and
Sentinels, trackers, haproxy), the real vLLM engines it can run instead of simulated ones, and
the flags of ``python -m bench.stack`` (:class:`StackSettings`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from publishers.config import EngineShape
from tracker.framework.settings import Settings, setting


@dataclass(frozen=True)
class VllmEngines:
    """Real vLLM engines (its CPU build, ``scripts/vllm-install``) in place of simulated ones.

    :param binary: the ``vllm`` entry point of the virtualenv it is installed in.
    :param model: the model directory served (and the routers' tokenizer and chat template).
    :param num_gpu_blocks: KV-cache blocks per engine (``--num-gpu-blocks-override``); None:
        what ``VLLM_CPU_KVCACHE_SPACE`` holds.
    :param nice: niceness of the engines: vLLM's CPU engine busy-polls, and two of them on a
        2-core machine starve the tracker of the time to apply their events.
    """

    binary: Path
    model: Path
    num_gpu_blocks: int | None = None
    max_model_len: int = 4096
    nice: int = 5
    pin: bool = False  # engine i on core i (taskset): the engines stop competing for cores
    attach: bool = False  # register through kvrouter's vllm.general_plugins shim (needs Redis)
    events_host: str = "*"  # anything but a wildcard makes vLLM connect its PUB socket out
    env: tuple[tuple[str, str], ...] = (
        ("VLLM_TARGET_DEVICE", "cpu"),
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        ("OMP_NUM_THREADS", "1"),
        ("VLLM_SERVER_DEV_MODE", "1"),  # POST /reset_prefix_cache
    )

    def argv(
        self, model: str, block_size: int, port: int, events: int, replay: int, *, index: int = 0
    ) -> list[str]:
        events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds only a wildcard endpoint (and connects to anything else)
            "endpoint": f"tcp://{self.events_host}:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "",
        }
        core = index % (os.cpu_count() or 1)
        argv = [
            *(["taskset", "-c", str(core)] if self.pin else []),
            *(["nice", "-n", str(self.nice)] if self.nice else []),
            str(self.binary),
            "serve",
            str(self.model),
            "--served-model-name",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(block_size),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(events_config),
        ]
        if self.num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return argv


@dataclass(frozen=True)
class Gateway:
    """A real Envoy in front instead of haproxy, asking the routers, run as endpoint pickers
    (``kvrouter epp``), where each request goes; Envoy carries the bytes
    (:mod:`bench.stack.envoy`).

    :param fail_open: Envoy skips a picker it cannot reach (``failure_mode_allow``).
    :param buffered: the request body ``BUFFERED`` instead of ``FULL_DUPLEX_STREAMED`` (with
        which Envoy fails closed once a body chunk reached a picker, fail_open or not).
    :param tls: TLS to the pickers (their self-signed certificates), as GIE gateways connect.
    :param response_body: the response body streamed through the picker (it sees the first
        token, the usage and the end); False: only the response headers.
    """

    fail_open: bool = False
    buffered: bool = False
    tls: bool = True
    response_body: bool = True


@dataclass(frozen=True, kw_only=True)
class StackConfig(EngineShape):
    """Shape of the local stack; its engines' shape is the :class:`EngineShape` fields."""

    replicas: int = 4
    routers: int = 2
    redis: bool = True
    # Redis as a primary, one replica and three Sentinels (quorum 2): every part gets the
    # redis+sentinel:// URL and follows a failover (the processes are redis, redis-replica,
    # sentinel-0..2)
    sentinel: bool = False
    # > 0: a second tracker on standby (process standby-tracker), both elected by a lease of
    # this many seconds (kvrouter tracker --lease-ttl-s)
    tracker_lease_s: float = 0.0
    haproxy: bool = True
    # the routers run as endpoint pickers behind a real Envoy (which replaces haproxy)
    gateway: Gateway | None = None
    # each router keeps its own index, fed by every engine's events, and shares only the
    # load through Redis (kvrouter router --local-index)
    local_index: bool = False
    model: str = "default"
    router_args: tuple[str, ...] = ()
    replica_args: tuple[str, ...] = ()
    tracker_args: tuple[str, ...] = ()
    workdir: Path | None = None
    # one `kvrouter replica` process per engine (named replica-0 ..), so that a fault can hit
    # one engine; engine i's id is then replica-i-0 (see StackLayout.replica_ids)
    replica_processes: bool = False
    # real vLLM engines instead (named vllm-0 ..): registered by kvrouter's shim inside vLLM
    # (VllmEngines.attach), or else given to every process with --replica
    vllm: VllmEngines | None = None


@dataclass(frozen=True, kw_only=True)
class StackSettings(Settings):
    """``python -m bench.stack``: the local stack's shape, from flags (defaults: StackConfig's)."""

    PART = "STACK"

    replicas: int = setting(StackConfig.replicas, "simulated engines")
    routers: int = setting(StackConfig.routers, "routers (behind haproxy when more than 1)")
    redis: bool = setting(
        StackConfig.redis, "Redis and a tracker (--no-redis: embedded, one router)"
    )
    haproxy: bool = setting(
        StackConfig.haproxy, "haproxy in front (--no-haproxy: clients talk to router-0)"
    )
    gateway: bool = setting(
        False,
        "the routers as endpoint pickers (kvrouter epp) behind a real Envoy, which replaces "
        "haproxy (needs --redis)",
    )
    model: str = setting(StackConfig.model, "served model name")
    block_size: int = setting(StackConfig.block_size, "KV-cache block size in tokens")
    num_blocks: int = setting(StackConfig.num_blocks, "KV-cache blocks per engine")
    time_scale: float = setting(StackConfig.time_scale, "multiply every simulated duration")
    workdir: str | None = setting(None, "log directory (default: a new temp dir)")
    timeout_s: float = setting(60.0, "startup budget")

    def config(self) -> StackConfig:
        return StackConfig(
            replicas=self.replicas,
            routers=self.routers if self.redis else 1,
            redis=self.redis,
            haproxy=self.haproxy,
            gateway=Gateway() if self.gateway and self.redis else None,
            model=self.model,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            time_scale=self.time_scale,
            workdir=Path(self.workdir) if self.workdir else None,
        )
