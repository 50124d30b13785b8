"""``kvrouter bench``: replay one workload through every routing policy on one fleet; report.

See docs/benchmarks.md for the method (capacity, time scale, cache resets) and the results.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench.agents import AgentShape, agents
from bench.capacity import capacity, measure_shape
from bench.fleet import FleetConfig
from bench.harness import POLICIES, Harness
from bench.peers import PEERS, install_hint, missing
from bench.plan import Plan
from bench.plots import require_matplotlib
from bench.stack.config import Gateway, VllmEngines
from bench.workloads import (
    WORKLOADS,
    Workload,
    mooncake,
    multi_turn,
    no_sharing,
    planned_span,
    shared_prefix,
    with_poisson_arrivals,
)
from tracker.core.tokens import Tokenizer
from tracker.framework.cli import Command
from tracker.framework.config import LogSettings
from tracker.framework.errors import ConfigError
from tracker.framework.settings import comma_list, setting

DEFAULT_TRACE: Final = Path(__file__).parent / "traces" / "synthetic_mooncake_sample.jsonl"
FULL: Final = FleetConfig()
"""The fleet of a run that sets nothing: its defaults are FleetConfig's."""
QUICK: Final = FleetConfig(replicas=4, num_blocks=512, time_scale=2.0)
"""The fleet of a ``--quick`` run."""
SIZES: Final[dict[str, dict[str, tuple[int, int]]]] = {
    "gsp": {
        "groups": (64, 8),
        "prompts_per_group": (16, 8),
        "system_tokens": (2048, 1024),
        "question_tokens": (128, 64),
        "output_tokens": (256, 128),
    },
    "llmd": {
        "groups": (150, 8),
        "prompts_per_group": (5, 8),
        "system_tokens": (6000, 1024),
        "question_tokens": (1200, 64),
        "output_tokens": (1000, 128),
    },
    "nosharing": {
        "system_tokens": (2048, 1024),
        "question_tokens": (128, 64),
        "output_tokens": (256, 128),
    },
    "multiturn": {
        "system_tokens": (1000, 512),
        "question_tokens": (64, 32),
        "output_tokens": (100, 32),
    },
}
"""Per workload, the (default, ``--quick``) value of each size setting left unset."""
_QUICK_GSP: Final = {name: quick for name, (_, quick) in SIZES["gsp"].items()}
AGENTS: Final = AgentShape()
"""The ``agents`` workload's defaults; each of its fields is the setting ``agents_<field>``."""
AGENTS_BLOCKS: Final = 16384
"""The ``agents`` workload's engines when ``--num-blocks`` is unset: 262k tokens each, room
for two or three of its sessions at their ~100k-token end (4,096 would not hold one)."""


def _defaults(name: str) -> str:
    """Help text: each workload's default for the size setting ``name``, then the quick ones."""
    sizes = {workload: table[name] for workload, table in SIZES.items() if name in table}
    full = ", ".join(f"{workload} {value}" for workload, (value, _) in sizes.items())
    return f"default {full}; quick {', '.join(str(quick) for _, quick in sizes.values())}"


@dataclass(frozen=True, kw_only=True)
class BenchSettings(LogSettings):
    """``kvrouter bench``: routing policies compared on one workload and one fleet."""

    PART = "BENCH"

    workload: str = setting("gsp", "workload", choices=WORKLOADS)
    policies: str = setting(
        ",".join(POLICIES), "comma-separated policies, run in this order: " + ", ".join(POLICIES)
    )
    quick: bool = setting(
        False,
        f"smoke run (about a minute): {QUICK.replicas} small engines ({QUICK.num_blocks} "
        f"blocks), {_QUICK_GSP['groups']} groups x {_QUICK_GSP['prompts_per_group']} prompts "
        f"of {_QUICK_GSP['system_tokens']} + {_QUICK_GSP['question_tokens']} tokens, "
        f"{_QUICK_GSP['output_tokens']} out, time scale {QUICK.time_scale:g}",
    )
    json: str | None = setting(None, "write the results as JSON to this file")
    raw: bool = setting(False, "with --json: every request's result too (for analysis)")
    plot: str | None = setting(None, "write the TTFT CDF to this PNG (and FILE-bars.png)")
    replicas: int | None = setting(
        None, f"simulated engines (default {FULL.replicas}; quick {QUICK.replicas})"
    )
    routers: int = setting(1, "routers (more than 1: behind haproxy, sharing load via Redis)")
    embedded: bool = setting(False, "one router with its in-process tracker, no Redis")
    local_index: bool = setting(
        False, "each router keeps its own index from the engines' events; Redis shares the load"
    )
    gateway: bool = setting(
        False,
        "the routers run as endpoint pickers (kvrouter epp) behind a real Envoy instead of "
        "haproxy; the real peers, proxies that cannot be asked, are skipped",
    )
    time_scale: float | None = setting(
        None,
        "engine time scale: real seconds per simulated second "
        f"(default {FULL.time_scale:g}; quick {QUICK.time_scale:g})",
    )
    load: float = setting(0.75, "arrival rate as a share of the fleet's estimated capacity")
    rate: float | None = setting(None, "arrival rate in requests per simulated second (wins)")
    seed: int = setting(1, "workload and arrival seed")
    num_blocks: int | None = setting(
        None,
        f"KV-cache blocks per engine, {FULL.block_size} tokens each "
        f"(default {FULL.num_blocks}; agents {AGENTS_BLOCKS}; quick {QUICK.num_blocks})",
    )
    groups: int | None = setting(None, f"gsp/llmd: prefix groups ({_defaults('groups')})")
    prompts_per_group: int | None = setting(
        None, f"gsp/llmd: prompts (users) per group ({_defaults('prompts_per_group')})"
    )
    system_tokens: int | None = setting(
        None, f"system prompt (shared prefix) tokens ({_defaults('system_tokens')})"
    )
    question_tokens: int | None = setting(None, f"question tokens ({_defaults('question_tokens')})")
    output_tokens: int | None = setting(None, f"output tokens ({_defaults('output_tokens')})")
    requests: int = setting(512, "nosharing: requests")
    users: int = setting(64, "multiturn: conversations")
    rounds: int = setting(6, "multiturn: turns per conversation")
    context_tokens: int = setting(2000, "multiturn: private context in each first message")
    think_s: float = setting(2.0, "multiturn: mean think time between turns (simulated s)")
    trace: str | None = setting(None, "trace: Mooncake JSONL file (default: the bundled sample)")
    speedup: float = setting(1.0, "trace: replay this many times faster than its timestamps")
    max_requests: int | None = setting(None, "trace: replay at most this many requests")
    trace_from: int = setting(
        0, "trace: skip this many requests first (another slice of the trace, its own clock)"
    )
    agents_sessions: int = setting(AGENTS.sessions, "agents: sessions")
    agents_turns: int = setting(AGENTS.turns, "agents: turns per session")
    agents_preamble_tokens: int = setting(
        AGENTS.preamble_tokens, "agents: tool/instruction preamble every session shares"
    )
    agents_context_tokens: int = setting(
        AGENTS.context_tokens, "agents: each session's own repository context"
    )
    agents_task_tokens: int = setting(
        AGENTS.task_tokens, "agents: task text of a session and of each subagent"
    )
    agents_growth_tokens: int = setting(
        AGENTS.growth_tokens, "agents: mean tool result added per turn (uniform 1/4 to 7/4 of it)"
    )
    agents_output_tokens: int = setting(
        AGENTS.output_tokens, "agents: mean answer tokens (uniform 1/2 to 3/2 of it)"
    )
    agents_think_s: float = setting(
        AGENTS.think_s, "agents: mean tool time before each request (exponential, simulated s)"
    )
    agents_fanout: int = setting(
        AGENTS.fanout, "agents: subagents each burst starts at once (1: no subagents)"
    )
    agents_fanout_every: int = setting(
        AGENTS.fanout_every, "agents: a burst after every this many turns of a session"
    )
    agents_subagent_turns: int = setting(AGENTS.subagent_turns, "agents: turns per subagent")
    agents_closed_loop: bool = setting(
        AGENTS.closed_loop,
        "agents: each request waits for the answer it follows (default: planned sends)",
    )
    agents_key: bool = setting(
        AGENTS.key,
        "agents: send the session key (prompt_cache_key, x-session-id) and x-agent-id; "
        "--no-agents-key measures routing without them",
    )
    router_args: tuple[str, ...] = setting(
        (), "extra flag for every router, repeatable (e.g. --router-args=--tie-epsilon-ms=2)"
    )
    bypass: float = setting(
        0.0, "share of the conversations sent straight to an engine, past every router"
    )
    restart_engine_at_s: float | None = setting(
        None, "SIGKILL one engine this many simulated seconds into each pass and restart it"
    )
    vllm: str | None = setting(
        None,
        "real vLLM engines instead of simulated ones: the vllm entry point of their "
        "virtualenv (scripts/vllm-install makes .venv-vllm/bin/vllm); blocks of 32 tokens, "
        "real time, 2 engines by default",
    )
    vllm_model: str = setting(
        ".cache/tiny-qwen2",
        "with --vllm: the model directory the engines serve (the routers tokenize with its "
        "tokenizer and chat template)",
    )
    vllm_pin: bool = setting(
        False,
        "with --vllm: engine i runs on core i (taskset), so the engines do not compete for "
        "the same cores (on a host with fewer cores than engines they still do)",
    )

    def __post_init__(self) -> None:
        names = self.policy_list
        unknown = [p for p in names if p not in POLICIES]
        if unknown or not names:
            raise ConfigError(f"policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
        if not 0 < self.load <= 10:
            raise ConfigError("load must be in (0, 10]")
        if self.routers < 1 or (self.embedded and self.routers != 1):
            raise ConfigError("routers must be >= 1 (exactly 1 when embedded)")
        if self.embedded and self.local_index:
            raise ConfigError("local-index: not with embedded (its index is local already)")
        if not 0 <= self.bypass < 1:
            raise ConfigError("bypass must be in [0, 1)")
        if self.workload == "agents":
            try:
                self.agent_shape()
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.restart_engine_at_s is not None and self.restart_engine_at_s < 0:
            raise ConfigError("restart-engine-at-s must be >= 0")
        if self.trace_from < 0:
            raise ConfigError("trace-from must be >= 0")
        if self.vllm is not None:
            if not Path(self.vllm).is_file():
                raise ConfigError(f"vllm: no {self.vllm} (scripts/vllm-install installs it)")
            if not (Path(self.vllm_model) / "config.json").is_file():
                raise ConfigError(
                    f"vllm-model: no model in {self.vllm_model} (scripts/vllm-install builds one)"
                )
            if self.restart_engine_at_s is not None or self.embedded:
                raise ConfigError("vllm: not with restart-engine-at-s or embedded")

    @property
    def policy_list(self) -> tuple[str, ...]:
        return comma_list(self.policies, str)

    def agent_shape(self) -> AgentShape:
        """The ``agents`` workload's shape: the ``agents_*`` settings."""
        return AgentShape.from_settings(dataclasses.asdict(self))


def _size(settings: BenchSettings, name: str) -> int:
    """The size setting ``name``: as set, else the workload's default (:data:`SIZES`)."""
    value: int | None = getattr(settings, name)
    if value is not None:
        return value
    default, quick = SIZES[settings.workload][name]
    return quick if settings.quick else default


def build_workload(settings: BenchSettings) -> Workload:
    """The workload the settings describe (arrivals not assigned yet)."""
    s, q = settings, settings.quick
    if s.workload in ("gsp", "llmd"):
        return shared_prefix(
            groups=_size(s, "groups"),
            prompts_per_group=_size(s, "prompts_per_group"),
            system_tokens=_size(s, "system_tokens"),
            question_tokens=_size(s, "question_tokens"),
            output_tokens=_size(s, "output_tokens"),
            seed=s.seed,
            name=s.workload,
        )
    if s.workload == "nosharing":
        return no_sharing(
            requests=64 if q and s.requests == 512 else s.requests,
            system_tokens=_size(s, "system_tokens"),
            question_tokens=_size(s, "question_tokens"),
            output_tokens=_size(s, "output_tokens"),
            seed=s.seed,
        )
    if s.workload == "multiturn":
        return multi_turn(
            users=s.users,
            rounds=s.rounds,
            system_tokens=_size(s, "system_tokens"),
            context_tokens=s.context_tokens,
            question_tokens=_size(s, "question_tokens"),
            output_tokens=_size(s, "output_tokens"),
            think_s=s.think_s,
            seed=s.seed,
        )
    if s.workload == "agents":
        return agents(s.agent_shape(), s.seed)
    path = Path(s.trace) if s.trace else DEFAULT_TRACE
    if not path.exists():
        raise ConfigError(f"trace file {path} does not exist")
    return mooncake(
        path, speedup=s.speedup, max_requests=s.max_requests, seed=s.seed, skip=s.trace_from
    )


def plan(settings: BenchSettings) -> Plan:
    """Workload, fleet, capacity and arrival rate for ``settings``."""
    base = QUICK if settings.quick else FULL
    default_blocks = AGENTS_BLOCKS if settings.workload == "agents" else base.num_blocks
    num_blocks = settings.num_blocks or default_blocks
    vllm, tokenizer = None, Tokenizer.builtin()
    if settings.vllm is not None:
        model = Path(settings.vllm_model)
        vllm = VllmEngines(
            Path(settings.vllm), model, num_gpu_blocks=num_blocks, pin=settings.vllm_pin
        )
        tokenizer = Tokenizer.from_files(model)
    replicas = settings.replicas or (2 if vllm else base.replicas)
    fleet = FleetConfig(
        replicas=replicas,
        routers=settings.routers,
        redis=not settings.embedded,
        local_index=settings.local_index,
        # real engines run in real time, on the block size vLLM's CPU attention takes
        time_scale=1.0 if vllm else settings.time_scale or base.time_scale,
        num_blocks=num_blocks,
        block_size=32 if vllm else base.block_size,
        router_args=settings.router_args,
        bypass_share=settings.bypass,
        restart_engine_at_s=settings.restart_engine_at_s,
        seed=settings.seed,
        vllm=vllm,
        gateway=Gateway() if settings.gateway else None,
    )
    workload = build_workload(settings)
    shape = measure_shape(workload, fleet.block_size, tokenizer)
    if vllm is not None and shape.longest_request > vllm.max_model_len:
        raise ConfigError(
            f"a request of {shape.longest_request} tokens (prompt and output, as the model's "
            f"tokenizer counts them) does not fit vLLM's max-model-len {vllm.max_model_len}: "
            "shorten the prompts"
        )
    room = fleet.num_blocks * fleet.block_size
    if shape.longest_request > room:
        raise ConfigError(
            f"a request of {shape.longest_request} tokens (prompt and output) does not fit an "
            f"engine's KV cache of {fleet.num_blocks} blocks ({room} tokens): raise "
            "--num-blocks or shorten the prompts"
        )
    cap = capacity(shape, fleet, replicas)
    if workload.timed:
        duration = max((c.start_s for c in workload.conversations), default=0.0)
        rate = workload.requests / duration if duration > 0 else 0.0
    else:
        rate = settings.rate or settings.load * cap.ideal_rps
        workload = with_poisson_arrivals(workload, rate, settings.seed)
        span = planned_span(workload)
        if span > 0:  # sessions of planned sends: what arrives is their plan, not the pace
            rate = workload.requests / span
    load = rate / cap.ideal_rps if cap.ideal_rps else 0.0
    return Plan(workload, fleet, settings.policy_list, shape, cap, rate, load)


def runnable(chosen: Plan, stage: Callable[[str], None]) -> Plan:
    """``chosen`` without the arms that cannot run, each skip said through ``stage``: the
    peers not installed, and behind a gateway every peer (a proxy: Envoy asks only pickers)."""
    skipped: set[str] = set()
    if chosen.fleet.gateway is not None:
        peers = [p for p in chosen.policies if p in PEERS]
        if peers:
            stage(
                f"skipping {', '.join(peers)}: a peer is a proxy, not an endpoint picker, so "
                "the gateway cannot ask it"
            )
            skipped.update(peers)
    absent = {k: v for k, v in missing(chosen.policies).items() if k not in skipped}
    if absent:
        packages = ", ".join(sorted(set(absent.values())))
        hints = "; ".join(sorted({install_hint(name) for name in absent}))
        stage(f"skipping {', '.join(absent)}: {packages} not installed ({hints})")
        skipped.update(absent)
    return dataclasses.replace(
        chosen, policies=tuple(p for p in chosen.policies if p not in skipped)
    )


def run(settings: BenchSettings) -> int:
    from bench.console import Console  # rich only when the command runs

    if settings.plot:
        require_matplotlib("--plot")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    console = Console()
    chosen = runnable(plan(settings), console.stage)
    if not chosen.policies:
        return 1
    console.plan(chosen)
    runs = Harness(chosen.fleet, chosen.workload, chosen.policies, console).run()
    return console.finish(
        chosen,
        runs,
        json_path=Path(settings.json) if settings.json else None,
        raw=settings.raw,
        plot_path=Path(settings.plot) if settings.plot else None,
    )


BENCH = Command(
    "bench",
    "compare routing policies on simulated engines: one workload, same arrivals, side by side",
    BenchSettings,
    run,
)
