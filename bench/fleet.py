"""The fleet a benchmark run starts (:class:`FleetConfig`): its engines' shape, the routers and
the scenario knobs, and the engine-time constants and guards its routers are given."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench.stack.config import Gateway, StackConfig, VllmEngines
from publishers.config import EngineShape, shape_fields
from publishers.sim.latency import LatencyProfile, load_profile
from router.decide.policy_types import PolicyConfig, SpeedEstimate
from router.decide.scoring import prefill_work

# Real-time router guards sized for a shared benchmark machine, where the router's event loop
# and Redis are descheduled for tens of ms at a time (docs/benchmarks.md); deployments keep
# the defaults (10 ms index budget, 1 s connect timeout). Later --router-args win.
BENCH_ROUTER_ARGS: Final = ("--lookup-timeout-ms", "100", "--connect-timeout-s", "10")


def lone_prefill_speed(
    profile: LatencyProfile, max_num_batched_tokens: int, time_scale: float = 1.0
) -> SpeedEstimate:
    """The simulated prefill of a lone prompt on an idle engine (its chunks one step each),
    as a line over its work (:func:`router.decide.scoring.prefill_work`), times
    ``time_scale``: the slope between 1k and 8k tokens, the floor through a hit's 64-token
    tail (the step floor)."""

    def lone_ms(tokens: int) -> float:
        return profile.lone_prefill_ms(tokens, max_num_batched_tokens) * time_scale

    def work(tokens: int) -> float:
        return prefill_work(tokens, 0, profile.attention_tokens)

    short, long = 1024, 8192
    slope = (lone_ms(long) - lone_ms(short)) / (work(long) - work(short))
    return SpeedEstimate(max(0.0, lone_ms(64) - slope * work(64)), slope)


@dataclass(frozen=True, kw_only=True)
class FleetConfig(EngineShape):
    """The fleet every policy runs on: ``replicas`` engines of this shape, and the routers.

    The defaults are ``kvrouter bench``'s (:mod:`bench.commands` shows them in its help):
    engines many times slower than an H200, so that the router's own time, in real
    milliseconds, weighs little in simulated latencies (docs/benchmarks.md, "Time scale").
    """

    time_scale: float = 20.0
    replicas: int = 8
    routers: int = 1
    redis: bool = True
    local_index: bool = False
    router_args: tuple[str, ...] = ()
    replica_args: tuple[str, ...] = ()
    workdir: Path | None = None
    bypass_share: float = 0.0
    restart_engine_at_s: float | None = None
    seed: int = 1
    # real vLLM engines instead of simulated ones (served as "default"; time scale 1)
    vllm: VllmEngines | None = None
    # the routers run as endpoint pickers (kvrouter epp) behind a real Envoy, not haproxy
    gateway: Gateway | None = None

    def prefill_seed_args(self) -> tuple[str, ...]:
        """The routers' engine-time constants for these engines, as a deployment seeds its own
        from calibration: the prefill-speed seed, a lone prompt's simulated prefill (chunked
        as the engines chunk it) at 1k and 8k tokens, in the real milliseconds the engines
        take at this time scale; and the policy's other durations (the KV-full penalty, the
        decode cost of a running request), ``time_scale`` times an H200's. The defaults are
        an H200's: 3x too fast for engines at time scale 3. The slope is learned only from
        the rare cold prefills (docs/architecture.md); the other two are not learned, and
        unscaled they made a full home look a third as slow as it was (load 50 %: TTFT p95
        582 ms against 169 scaled, docs/benchmarks.md)."""
        profile = load_profile(self.profile, floor_ms=self.floor_ms)
        speed = lone_prefill_speed(profile, self.max_num_batched_tokens, self.time_scale)
        policy = PolicyConfig()
        return (
            "--attention-tokens",
            f"{profile.attention_tokens:.0f}",
            "--prefill-floor-ms",
            f"{speed.floor_ms:.3f}",
            "--prefill-ms-per-token",
            f"{speed.prefill_ms_per_token:.6f}",
            "--kv-full-penalty-ms",
            f"{policy.kv_full_penalty_ms * self.time_scale:.3f}",
            "--decode-ms-per-request",
            f"{policy.decode_ms_per_request * self.time_scale:.6f}",
        )

    def stack(self) -> StackConfig:
        return StackConfig(
            **shape_fields(self),
            replicas=self.replicas,
            routers=self.routers if self.redis else 1,
            redis=self.redis,
            haproxy=self.redis and self.routers > 1,
            gateway=self.gateway,
            local_index=self.local_index,
            router_args=(
                *BENCH_ROUTER_ARGS,
                *self.prefill_seed_args(),
                # the same random choices run after run: arms and modes compare decision by
                # decision on the same arrivals
                "--random-seed",
                str(self.seed),
                *self.router_args,
            ),
            # vllm-router replays only from the 4-frame layout (kvrouter reads both)
            replica_args=("--replay-layout", "topic", *self.replica_args),
            workdir=self.workdir,
            # one process per engine, so that one engine can be restarted alone
            replica_processes=self.restart_engine_at_s is not None,
            vllm=self.vllm,
        )
