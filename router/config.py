"""Settings of ``kvrouter router``: one frozen object, its fields are the flags and the env."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from router.baselines import POLICIES
from router.decide.policy_types import DEFAULT_SPEED, PolicyConfig, SpeedEstimate
from tracker.core.index import LOAD_TTL_S
from tracker.core.replicas import ReplicaSpec
from tracker.framework.config import ServiceSettings
from tracker.framework.errors import ConfigError
from tracker.framework.settings import setting

_POLICY: Final = PolicyConfig()  # the policy's own defaults, for the settings that seed it


def model_paths(entries: tuple[str, ...], what: str) -> tuple[str | None, dict[str, str]]:
    """``(path for every model, {model: path})`` from ``PATH`` and ``MODEL=PATH`` entries."""
    default: str | None = None
    per_model: dict[str, str] = {}
    for entry in entries:
        model, eq, path = entry.partition("=")
        if not eq:
            if default is not None:
                raise ConfigError(f"{what}: more than one path for every model")
            default = entry
        elif not model or not path:
            raise ConfigError(f"{what}: expected PATH or MODEL=PATH, got {entry!r}")
        elif model in per_model:
            raise ConfigError(f"{what}: model {model!r} given twice")
        else:
            per_model[model] = path
    return default, per_model


@dataclass(frozen=True, kw_only=True)
class RouterSettings(ServiceSettings):
    """``kvrouter router``: the KV-cache-aware OpenAI-compatible proxy."""

    PART = "ROUTER"

    host: str = setting("127.0.0.1", "HTTP bind address")
    port: int = setting(8000, "HTTP port (0: any free port)")
    redis: str | None = setting(
        None,
        "Redis URL of the shared index, load and registry (or "
        "redis+sentinel://HOST:PORT,.../SERVICE, redis+cluster://HOST:PORT,...); omit: "
        "embedded index + tracker",
    )
    replica: tuple[str, ...] = setting(
        (),
        "replica, repeatable: ID=tcp://host:5557[,replay=tcp://host:5558],url=http://host:8000"
        "[,model=M][,block_size=N]",
    )
    discover: bool = setting(True, "with --redis, also route to replicas in the registry")
    local_index: bool = setting(
        False,
        "with --redis: keep the block index in this process, fed by the --replica event "
        "endpoints (as without --redis), and share only the load and routes through Redis",
    )
    model: str = setting("default", "model served by replicas given with --replica")
    block_size: int = setting(16, "block size of --replica replicas without their own")
    tokenizer: tuple[str, ...] = setting(
        (), "tokenizer.json or its directory, for every model or as MODEL=PATH (default: builtin)"
    )
    chat_template: tuple[str, ...] = setting(
        (), "chat template (.jinja or tokenizer_config.json), for every model or as MODEL=PATH"
    )
    api_key: str | None = setting(None, "bearer key of the OpenAI routes", secret=True)
    api_key_file: str | None = setting(None, "file with bearer keys of the OpenAI routes")
    admin_key: str | None = setting(
        None, "bearer key of /index, /replicas, /metrics (default: the API key)", secret=True
    )
    admin_key_file: str | None = setting(None, "file with bearer keys of the operator routes")
    upstream_api_key: str | None = setting(
        None, "bearer key sent to replicas (vLLM --api-key)", secret=True
    )
    policy: str = setting(
        "ttft",
        "routing policy: ttft (kvrouter), linear; baselines for benchmarks: round-robin, "
        "least-load, seed, sglang, oracle (simulated engines only)",
        choices=POLICIES,
    )
    hit_weight: float = setting(_POLICY.hit_weight, "linear policy: weight of a cached block")
    load_weight: float = setting(
        _POLICY.load_weight, "linear policy: weight of a request in flight"
    )
    seed_user_chars: int = setting(
        0, "seed policy: characters of the first user message hashed with the system prompt"
    )
    sglang_cache_threshold: float = setting(
        0.3, "sglang policy: matched share of the text above which the matching replica wins"
    )
    sglang_balance_abs_threshold: int = setting(
        64, "sglang policy: in-flight spread (max - min) above which load alone decides"
    )
    sglang_balance_rel_threshold: float = setting(
        1.5, "sglang policy: ... and max in flight above this multiple of min"
    )
    offload_hit_cost: float = setting(
        _POLICY.offload_hit_cost,
        "cost of a hit in the engine host's CPU memory relative to recompute",
    )
    storage_hit_cost: float = setting(
        _POLICY.storage_hit_cost,
        "cost of a hit in the engine host's storage tier relative to recompute",
    )
    remote_hit_cost: float = setting(
        _POLICY.remote_hit_cost, "cost of a hit in a remote (network) store relative to recompute"
    )
    default_output_tokens: int = setting(
        256, "KV memory a request without max_tokens is expected to grow by, in tokens"
    )
    temperature: float = setting(
        _POLICY.temperature, "softmax temperature in ms (0: best score, random ties)"
    )
    tie_epsilon_ms: float = setting(_POLICY.tie_epsilon_ms, "expected TTFTs this close are a tie")
    tie_ratio: float = setting(
        _POLICY.tie_ratio,
        "expected costs within this share of the best one are a near-tie (the estimate's "
        "error), given to the prompt's home, then the replica holding most of the prompt",
    )
    miss_weight: float = setting(
        _POLICY.miss_weight,
        "ttft policy: a miss that evicts, or leaves a prefix's home, costs (weight - 1) "
        "times the prefill it causes again, times 1 + the fleet's mean requests in flight "
        "(1: no such cost)",
    )
    kv_full_penalty_ms: float = setting(
        _POLICY.kv_full_penalty_ms,
        "ttft policy: expected wait at full projected KV usage (growing linearly from the "
        "0.9 watermark, up to 5x at 1.5); like the prefill seed, in the engines' time",
    )
    decode_ms_per_request: float = setting(
        _POLICY.decode_ms_per_request,
        "ttft policy: ms each running request adds to an engine step (its KV read)",
    )
    prefill_floor_ms: float = setting(
        DEFAULT_SPEED.floor_ms,
        "seed of the learned prefill speed: ms a prefill costs besides its tokens "
        "(default: Llama-3.1-8B on one H200; seed other fleets from their own calibration)",
    )
    prefill_ms_per_token: float = setting(
        DEFAULT_SPEED.prefill_ms_per_token,
        "seed of the learned prefill speed: ms per uncached prompt token of a short prompt "
        "(longer ones cost more, see --attention-tokens; the slope is learned from the rare "
        "cold prefills: a seed far off stays off for long)",
    )
    attention_tokens: float = setting(
        _POLICY.attention_tokens,
        "ttft policy: context length at which a prompt token's attention costs as much as the "
        "rest of its prefill, so a 100k-token prefill costs ~3x a short prompt's per token "
        "(default: Llama-3.1-8B on an H200; ~40,000 for Llama-70B; 0: linear)",
    )
    lookup_timeout_ms: float = setting(10.0, "time budget of the index lookup and load snapshot")
    lookup_timeout_per_block_us: float = setting(
        2.0, "extra lookup budget per block of the prompt, in µs (long prompts walk more blocks)"
    )
    breaker_failures: int = setting(3, "index failures in a row that open the circuit breaker")
    breaker_cooldown_s: float = setting(2.0, "how long the open breaker skips the index")
    lookahead_tokens: int | None = setting(
        None,
        "tokens after each block that the engines fold into its hash (vLLM 0.33 lookahead "
        "hashing with EAGLE-style drafting; default: what the tracker saw in their events)",
    )
    predict_ttl_s: float = setting(
        3.0, "predict-on-route: the replica sent to holds the prompt's blocks this long (0: off)"
    )
    home_ttl_s: float = setting(
        120.0,
        "a prefix's home (the replica it was last routed to) keeps priority this long after "
        "its blocks are evicted, fading linearly (0: off)",
    )
    session_header: str = setting(
        "x-session-id",
        "request header naming a session whose turns keep to one replica while it has room, "
        "like OpenAI's prompt_cache_key field, which takes precedence ('': none)",
    )
    reuse_window_s: float = setting(
        30.0,
        "a replica's cached prefix counts as worth keeping (evicting it costs) while routed "
        "requests were sent there with it within this window; the rest of its cache is free "
        "to evict (0: every cached block counts)",
    )
    recent_load_half_life_s: float = setting(
        1.0,
        "a replica's requests in flight over the last seconds (mean, halving its weight "
        "this often), scaled by the part of a cold prefill that evicts reused prefixes, "
        "price that prefill there when more than its count now, and order ties between "
        "new prompts: an engine whose requests just finished does not stay idle (0: off)",
    )
    connect_timeout_s: float = setting(1.0, "upstream connect timeout")
    first_byte_timeout_s: float = setting(
        600.0, "upstream answer timeout (a stream's first chunk; a whole non-stream answer)"
    )
    read_timeout_s: float = setting(120.0, "longest wait between two chunks of a stream")
    retries: int = setting(1, "retries on the next-best replica before the first byte")
    random_seed: int | None = setting(
        None,
        "seed of the policy's random choices (near-ties, temperature): a benchmark's paired "
        "runs then choose alike (default: unseeded)",
    )
    shed_inflight: int = setting(
        0,
        "shed a request with 429 when every replica that could serve it has this many "
        "requests in flight from all routers (0: never)",
    )
    max_connections: int = setting(1024, "upstream connections to each replica (own pool)")
    health_interval_s: float = setting(2.0, "time between active health checks of a replica")
    health_timeout_s: float = setting(1.0, "timeout of one health check")
    unhealthy_after: int = setting(3, "failures in a row that take a replica out of rotation")
    metrics_interval_s: float = setting(1.0, "time between scrapes of engine /metrics (0: off)")
    metrics_stale_s: float = setting(5.0, "engine metrics older than this are ignored")
    registry_interval_s: float = setting(1.0, "time between registry refreshes")
    lease_ttl_s: float = setting(LOAD_TTL_S, "shared load of a dead router expires after this long")
    load_renew_s: float = setting(1.0, "how often this router renews its shared load")
    load_refresh_ms: float = setting(
        10.0,
        "with --local-index: how often the other routers' load and routes are read from "
        "Redis; a request takes the last read (0: the load read in every request's path)",
    )
    router_id: str | None = setting(
        None, "unique id of this router (default: host-pid-random; workers add -0, -1, ...)"
    )
    workers: int = setting(
        1,
        "router processes serving the port, each a router sharing load through Redis "
        "(0: one per usable core; more than 1 needs --redis)",
    )
    max_body_bytes: int = setting(32 << 20, "largest accepted request body (413 above)")
    max_prompt_tokens: int = setting(1 << 20, "longest accepted prompt in tokens (400 above)")
    tokenizer_cache_tokens: int = setting(4_000_000, "segment cache of each tokenizer, in tokens")
    mismatch_window: int = setting(
        50, "engine-reported hits looked at when checking for a block-key mismatch"
    )
    mismatch_ratio: float = setting(
        0.9, "share of engine hits the router predicted none of that flags a mismatch"
    )
    shutdown_timeout_s: float = setting(30.0, "graceful drain budget for in-flight requests")
    decision_log: str | None = setting(
        None, "append every routing decision (candidates, matches, scores) as JSON lines here"
    )

    def __post_init__(self) -> None:
        specs = [ReplicaSpec.parse(spec) for spec in self.replica]
        for spec in specs:
            if spec.url is None:
                raise ConfigError(f"replica {spec.id!r} needs url=http://host:port to be routed")
        if len({s.id for s in specs}) != len(specs):
            raise ConfigError("a replica id is given twice")
        self._check_hashing()
        model_paths(self.tokenizer, "tokenizer")
        model_paths(self.chat_template, "chat-template")
        positive = (
            "connect_timeout_s",
            "first_byte_timeout_s",
            "read_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "registry_interval_s",
            "metrics_stale_s",
            "lookup_timeout_ms",
            "breaker_cooldown_s",
            "shutdown_timeout_s",
            "max_connections",
            "max_body_bytes",
            "max_prompt_tokens",
            "breaker_failures",
            "unhealthy_after",
            "mismatch_window",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name.replace('_', '-')} must be positive")
        for name in (
            "retries",
            "shed_inflight",
            "predict_ttl_s",
            "home_ttl_s",
            "reuse_window_s",
            "recent_load_half_life_s",
            "metrics_interval_s",
            "tokenizer_cache_tokens",
            "lookup_timeout_per_block_us",
            "seed_user_chars",
            "sglang_balance_abs_threshold",
            "default_output_tokens",
            "kv_full_penalty_ms",
            "decode_ms_per_request",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 0")
        if not (self.miss_weight >= 1 and math.isfinite(self.miss_weight)):
            raise ConfigError("miss-weight must be a finite number >= 1")
        if self.load_refresh_ms < 0 or not math.isfinite(self.load_refresh_ms):
            raise ConfigError("load-refresh-ms must be a finite number >= 0")
        if not 0 < self.load_renew_s < self.lease_ttl_s:
            raise ConfigError("need 0 < load-renew-s < lease-ttl-s")
        self._check_baselines()
        self._check_speed()
        self._check_workers()
        if not 0 < self.mismatch_ratio <= 1:
            raise ConfigError("mismatch-ratio must be in (0, 1]")
        if self.router_id is not None and (not self.router_id or "\x00" in self.router_id):
            raise ConfigError("router-id must be non-empty, without NUL characters")
        try:
            self.policy_config(self.block_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _check_workers(self) -> None:
        if self.workers < 0:
            raise ConfigError("workers must be >= 0")
        if self.workers != 1 and not self.redis:
            raise ConfigError(
                "workers: more than one router process needs --redis (the embedded index "
                "lives in one process)"
            )
        if self.local_index and not self.redis:
            raise ConfigError("local-index needs --redis (without it the index is local anyway)")
        if self.local_index and not self.replica:
            raise ConfigError("local-index needs --replica endpoints to feed the index")

    def _check_hashing(self) -> None:
        if self.block_size <= 0:
            raise ConfigError("block-size must be positive")
        if (self.lookahead_tokens or 0) < 0:
            raise ConfigError("lookahead-tokens must be >= 0")

    def _check_speed(self) -> None:
        if not (self.prefill_ms_per_token > 0 and math.isfinite(self.prefill_ms_per_token)):
            raise ConfigError("prefill-ms-per-token must be a positive number")
        if not (self.prefill_floor_ms >= 0 and math.isfinite(self.prefill_floor_ms)):
            raise ConfigError("prefill-floor-ms must be a finite number >= 0")

    def _check_baselines(self) -> None:
        if not 0 <= self.sglang_cache_threshold <= 1:
            raise ConfigError("sglang-cache-threshold must be in [0, 1]")
        if not self.sglang_balance_rel_threshold >= 1:
            raise ConfigError("sglang-balance-rel-threshold must be >= 1")

    @property
    def replica_specs(self) -> list[ReplicaSpec]:
        return [ReplicaSpec.parse(spec) for spec in self.replica]

    @property
    def prefill_seed(self) -> SpeedEstimate:
        """Where the learned prefill speed starts (:class:`router.decide.estimator.SpeedBook`)."""
        return SpeedEstimate(self.prefill_floor_ms, self.prefill_ms_per_token)

    def policy_config(self, block_size: int) -> PolicyConfig:
        """The policy parameters for a namespace of ``block_size``."""
        return PolicyConfig(
            mode="linear" if self.policy == "linear" else "ttft",
            block_size=block_size,
            hit_weight=self.hit_weight,
            load_weight=self.load_weight,
            offload_hit_cost=self.offload_hit_cost,
            storage_hit_cost=self.storage_hit_cost,
            remote_hit_cost=self.remote_hit_cost,
            temperature=self.temperature,
            tie_epsilon_ms=self.tie_epsilon_ms,
            tie_ratio=self.tie_ratio,
            miss_weight=self.miss_weight,
            kv_full_penalty_ms=self.kv_full_penalty_ms,
            decode_ms_per_request=self.decode_ms_per_request,
            attention_tokens=self.attention_tokens,
        )


@dataclass(frozen=True, kw_only=True)
class EppSettings(RouterSettings):
    """``kvrouter epp``: the router's decisions as a Gateway API Inference Extension endpoint
    picker (Envoy ext_proc over gRPC); the gateway carries the bytes."""

    PART = "EPP"

    port: int = setting(9090, "HTTP port of /metrics, /health, /index, /replicas (0: any)")
    grpc_port: int = setting(9002, "ext_proc gRPC port the gateway sends requests to (0: any)")
    health_port: int = setting(
        9003,
        "grpc.health.v1 port, plaintext for the kubelet's probes: liveness, readiness, the "
        "ext_proc service (0: any)",
    )
    secure_serving: bool = setting(
        True,
        "serve gRPC over TLS (gateways connect with TLS and do not verify it): with "
        "--tls-cert/--tls-key, else a self-signed certificate made at start",
    )
    tls_cert: str | None = setting(None, "PEM certificate (chain) of the gRPC servers")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert", secret=True)
    max_streams: int = setting(
        4096, "concurrent ext_proc streams (requests in flight through the gateway) at most"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.workers != 1:
            raise ConfigError("workers: run more endpoint-picker replicas instead")
        for name in ("grpc_port", "health_port", "port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name.replace('_', '-')} must be a TCP port")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls-cert and tls-key go together")
        if self.tls_cert is not None and not self.secure_serving:
            raise ConfigError("tls-cert is given but --no-secure-serving turns TLS off")
        if self.max_streams <= 0:
            raise ConfigError("max-streams must be positive")
