"""Settings of the publishers' commands (``kvrouter replica``, ``kvrouter attach``).

Also :class:`EngineShape`, the simulated engine's shape declared once, and the endpoint rules
the settings check and the publishers apply when they bind and advertise: :func:`tcp_parts`,
:data:`WILDCARD_HOSTS`, :func:`check_port_ranges`.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass
from typing import Any, Final, Literal

from publishers.registration import DOWN_AFTER
from tracker.core.event_codec import WireEra
from tracker.core.index import RECORD_TTL_S
from tracker.framework.config import ServiceSettings
from tracker.framework.errors import ConfigError
from tracker.framework.settings import setting

_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_TCP: Final = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d{1,5})$")
WILDCARD_HOSTS: Final = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def tcp_parts(endpoint: str, what: str) -> tuple[str, int]:
    """(host, port) of a ``tcp://host:port`` endpoint, or ConfigError."""
    match = _TCP.match(endpoint)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ConfigError(f"{what}: expected tcp://HOST:PORT, got {endpoint!r}")
    return match["host"], int(match["port"])


def check_port_ranges(ranges: dict[str, tuple[int, int]]) -> None:
    """Raise ConfigError when two ``name -> (first port, count)`` ranges overlap."""
    items = sorted(ranges.items(), key=lambda item: item[1][0])
    for (name_a, (a, n)), (name_b, (b, _)) in itertools.pairwise(items):
        if b < a + n:
            raise ConfigError(
                f"port collision: {name_a} uses {a}..{a + n - 1}, {name_b} starts at {b}"
            )


def _check_id(value: str, what: str) -> None:
    if not _ID.match(value):
        raise ConfigError(f"{what}: {value!r} is not a valid replica id")


@dataclass(frozen=True, kw_only=True)
class EngineShape:
    """A simulated engine's size and speed, declared once.

    :class:`ReplicaSettings` takes its defaults from these fields (its fields of the same
    names); the engine's own config (:class:`publishers.sim.engine.EngineConfig`) and the
    benchmark's stack and fleet configs extend this class.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: KV-cache capacity in blocks.
        max_num_batched_tokens: scheduler token budget per step.
        max_num_seqs: most requests running at once.
        profile: latency profile name (:data:`publishers.sim.latency.PROFILES`).
        floor_ms: override of the profile's per-step floor (``None``: the profile's).
        time_scale: multiplies every step's duration (0.01 runs 100x faster than real).
    """

    block_size: int = 16
    num_blocks: int = 4096
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    profile: str = "llama-8b"
    floor_ms: float | None = None
    time_scale: float = 1.0

    def replica_flags(self) -> tuple[str, ...]:
        """This shape as ``kvrouter replica`` flags (an unset ``floor_ms`` left out)."""
        out: list[str] = []
        for name, value in shape_fields(self).items():
            if value is not None:
                out += ["--" + name.replace("_", "-"), str(value)]
        return tuple(out)


def shape_fields(source: object) -> dict[str, Any]:
    """The :class:`EngineShape` fields of ``source``, by name: a shape, a config that extends
    one, or settings with fields of the same names (:class:`ReplicaSettings`)."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(EngineShape)}


@dataclass(frozen=True, kw_only=True)
class ReplicaSettings(ServiceSettings):
    """``kvrouter replica``: simulated vLLM engines with their OpenAI server and KV events."""

    PART = "REPLICA"

    count: int = setting(1, "engines to start; engine i uses every port below + i")
    id_prefix: str = setting("replica-", "engine ids are <prefix>0 .. <prefix>N-1")
    host: str = setting("127.0.0.1", "HTTP bind address")
    port: int = setting(8000, "HTTP port of the first engine")
    events: str = setting(
        "tcp://*:5557",
        "ZMQ PUB endpoint of the first engine, by vLLM's rule: bound on a wildcard "
        "(tcp://*:P, tcp://[::]:P) or ipc://, connected out to any other address, loopback "
        "included (to a tracker's --bind)",
    )
    replay: str | None = setting(
        "tcp://127.0.0.1:5558",
        "ZMQ ROUTER replay endpoint of the first engine (always bound); 'none' disables",
    )
    topic: str = setting("", "topic frame of every event message (vLLM's default is empty)")
    era: str = setting("v0.33.0", "vLLM release whose wire format to emit (e.g. v0.25.1)")
    replay_layout: str | None = setting(
        None,
        "replay reply framing (default: the era's — 'topic' from v0.26, else 'legacy')",
        choices=("legacy", "topic"),
    )
    advertise_host: str | None = setting(
        None, "host put in registered URLs and endpoints (default: --host, or hostname)"
    )
    model: str = setting("default", "served model name")
    lora_modules: tuple[str, ...] = setting(
        (), "LoRA adapters served beside the model, by name (vLLM's --lora-modules NAME=PATH)"
    )
    max_model_len: int | None = setting(None, "longest prompt + output (default: cache size)")
    max_body_bytes: int = setting(32 << 20, "largest accepted request body (413 above)")
    block_size: int = setting(EngineShape.block_size, "KV-cache block size in tokens")
    num_blocks: int = setting(EngineShape.num_blocks, "KV-cache blocks per engine")
    max_num_batched_tokens: int = setting(
        EngineShape.max_num_batched_tokens, "scheduler token budget per step"
    )
    max_num_seqs: int = setting(EngineShape.max_num_seqs, "most requests running at once")
    profile: str = setting(EngineShape.profile, "latency profile")
    floor_ms: float | None = setting(
        EngineShape.floor_ms, "minimum step time in ms (default: the profile's)"
    )
    time_scale: float = setting(
        EngineShape.time_scale, "multiply every simulated duration (0.01 = 100x faster)"
    )
    hash_seed: str = setting("0", "PYTHONHASHSEED the block hashes are seeded with, as vLLM")
    lookahead_tokens: int = setting(
        0,
        "tokens after each block folded into its hash, as vLLM 0.33 does with EAGLE-style "
        "drafting (needs --era v0.33.0 or later; routers need the same --lookahead-tokens)",
    )
    offload_blocks: int = setting(
        0,
        "blocks of a CPU tier behind each engine's GPU cache, as vLLM's offloading connector "
        "keeps, announced with medium CPU (0: none; needs --era v0.24.0 or later)",
    )
    tokenizer: str | None = setting(None, "tokenizer.json or its directory (default: builtin)")
    chat_template: str | None = setting(
        None, "chat template (.jinja or tokenizer_config.json); default: the tokenizer's"
    )
    redis: str | None = setting(
        None,
        "registry Redis URL (or redis+sentinel://HOST:PORT,.../SERVICE, "
        "redis+cluster://HOST:PORT,...): register every engine and heartbeat",
    )
    heartbeat_s: float = setting(5.0, "seconds between registry heartbeats")
    ttl_s: float = setting(
        RECORD_TTL_S, "registry entries expire this long after the last heartbeat"
    )
    shutdown_timeout_s: float = setting(5.0, "graceful drain budget for in-flight requests")
    faults: bool = setting(
        False, "simulation only: accept POST /kvrouter/faults (event loss, for fault drills)"
    )

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError("count must be at least 1")
        if self.replay is not None and self.replay.strip().lower() in ("", "none", "off"):
            object.__setattr__(self, "replay", None)
        for i in range(self.count):
            _check_id(f"{self.id_prefix}{i}", "id-prefix")
        if not (self.port > 0 and self.port + self.count <= 65536):
            raise ConfigError(f"port: {self.port} + count does not fit in 1..65535")
        ranges = {"http ports": (self.port, self.count)}
        ranges["event ports"] = (tcp_parts(self.events, "events")[1], self.count)
        if self.replay is not None:
            ranges["replay ports"] = (tcp_parts(self.replay, "replay")[1], self.count)
        # HTTP is TCP too, but only a clash between the two ZMQ ranges is likely by default
        check_port_ranges(ranges)
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ConfigError("block-size and num-blocks must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("max-model-len must be positive")
        if self.max_body_bytes <= 0:
            raise ConfigError("max-body-bytes must be positive")
        if self.time_scale <= 0:
            raise ConfigError("time-scale must be positive")
        if not 0 < self.heartbeat_s * 2 <= self.ttl_s:
            raise ConfigError("heartbeat-s must be positive and at most half of ttl-s")
        self._check_era_features()

    def _check_era_features(self) -> None:
        era = WireEra.for_release(self.era)
        if self.lookahead_tokens < 0:
            raise ConfigError("lookahead-tokens must be >= 0")
        if self.lookahead_tokens and not era.at_least(WireEra.V0_33_0):
            raise ConfigError("lookahead-tokens: vLLM sends lookahead tokens from v0.33.0 on")
        if self.offload_blocks < 0:
            raise ConfigError("offload-blocks must be >= 0")
        if self.offload_blocks and not era.at_least(WireEra.V0_24_0):
            # earlier connectors sent raw digests in place of the GPU pool's hashes
            raise ConfigError("offload-blocks: the simulated CPU tier speaks vLLM v0.24.0 on")

    @property
    def wire_era(self) -> WireEra:
        return WireEra.for_release(self.era)

    @property
    def replay_framing(self) -> Literal["legacy", "topic"]:
        """The replay layout asked for, else the one the era's vLLM answers with."""
        if self.replay_layout is not None:
            return "topic" if self.replay_layout == "topic" else "legacy"
        return "topic" if self.wire_era.at_least(WireEra.V0_26_0) else "legacy"


@dataclass(frozen=True, kw_only=True)
class AttachSettings(ServiceSettings):
    """``kvrouter attach``: register a real vLLM server in the registry while it is healthy.

    The same fields, read from ``KVROUTER_ATTACH_*``, configure the vLLM general plugin.
    """

    PART = "ATTACH"

    redis: str | None = setting(None, "registry Redis URL")
    id: str | None = setting(None, "replica id to register")
    url: str | None = setting(None, "the vLLM server's base URL, e.g. http://host:8000")
    events: str = setting("tcp://127.0.0.1:5557", "where consumers connect to vLLM's PUB socket")
    replay: str | None = setting(
        "tcp://127.0.0.1:5558", "where consumers reach vLLM's replay socket; 'none' if off"
    )
    topic: str = setting("", "the kv-events-config topic")
    model: str = setting("default", "served model name (vLLM's --served-model-name)")
    block_size: int = setting(16, "vLLM's --block-size")
    data_parallel_size: int = setting(1, "vLLM's --data-parallel-size")
    data_parallel_rank: int = setting(
        0, "this server's rank with external DP load balancing (its ports are base + rank)"
    )
    hash_seed: str = setting("0", "the PYTHONHASHSEED vLLM must run with")
    heartbeat_s: float = setting(5.0, "seconds between heartbeats (and health probes)")
    ttl_s: float = setting(
        RECORD_TTL_S, "registry entries expire this long after the last heartbeat"
    )
    health_timeout_s: float = setting(2.0, "timeout of each GET /health")
    down_after: int = setting(DOWN_AFTER, "failed health probes in a row before deregistering")
    print_flags: bool = setting(False, "print the vLLM launch line for these settings and exit")

    def __post_init__(self) -> None:
        if self.replay is not None and self.replay.strip().lower() in ("", "none", "off"):
            object.__setattr__(self, "replay", None)
        if self.block_size <= 0:
            raise ConfigError("block-size must be positive")
        if not 0 <= self.data_parallel_rank < max(self.data_parallel_size, 1):
            raise ConfigError("data-parallel-rank must be in [0, data-parallel-size)")
        if not 0 < self.heartbeat_s * 2 <= self.ttl_s:
            raise ConfigError("heartbeat-s must be positive and at most half of ttl-s")
        endpoints = {"events": self.events} | ({"replay": self.replay} if self.replay else {})
        ranges = {}
        for name, endpoint in endpoints.items():
            if endpoint.startswith("ipc://"):
                if self.data_parallel_size > 1:
                    raise ConfigError(f"{name}: vLLM rejects ipc:// endpoints with DP > 1")
                continue
            host, port = tcp_parts(endpoint, name)
            if host in WILDCARD_HOSTS:
                raise ConfigError(
                    f"{name}: {endpoint!r} is a bind address; give the host consumers connect to"
                )
            ranges[f"{name} ports"] = (port, self.data_parallel_size)
        check_port_ranges(ranges)

    def require_attach(self) -> None:
        """The fields ``attach`` (not ``--print-flags``) needs."""
        for name in ("redis", "id", "url"):
            if not getattr(self, name):
                raise ConfigError(f"{name} is required (--{name} or {self.env_name(name)})")
        assert self.id is not None and self.url is not None
        _check_id(self.id, "id")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"url must be http(s), got {self.url!r}")
