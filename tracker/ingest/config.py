"""Settings of the tracker's commands (``kvrouter tracker``, ``kvrouter lookup``)."""

from __future__ import annotations

from dataclasses import dataclass

from tracker.core.replicas import ReplicaSpec
from tracker.framework.config import LogSettings, ServiceSettings
from tracker.framework.settings import setting


@dataclass(frozen=True, kw_only=True)
class TrackerSettings(ServiceSettings):
    """``kvrouter tracker``: consume KV events and maintain the block index."""

    PART = "TRACKER"

    redis: str | None = setting(
        None,
        "Redis URL of the shared index (redis://, rediss://, unix://, "
        "redis+sentinel://HOST:PORT,.../SERVICE, redis+cluster://HOST:PORT,...); omit for "
        "embedded",
    )
    replica: tuple[str, ...] = setting(
        (),
        "replica to track, repeatable: ID=tcp://host:5557[,replay=tcp://host:5558]"
        "[,url=http://host:8000]",
    )
    discover: bool = setting(True, "also track replicas found in the Redis registry")
    model: str = setting("default", "model served by replicas given with --replica")
    block_size: int = setting(16, "engine block size of replicas given with --replica")
    bind: str | None = setting(
        None, "also bind a SUB socket here for publishers that connect in (topic = replica id)"
    )
    topic: str = setting("", "ZMQ subscription prefix (vLLM's default topic is empty)")
    http_host: str = setting("127.0.0.1", "address of the /metrics and /health server")
    http_port: int = setting(9100, "port of the /metrics and /health server (0: disabled)")
    replay_timeout_s: float = setting(2.0, "give up on a replay after this long")
    max_replays: int = setting(8, "replay requests in flight at once, across all replicas")
    resync_cooldown_s: float = setting(5.0, "minimum time between resyncs of one replica")
    silence_check_s: float = setting(
        10.0,
        "poll a replica's replay after this long without live events; events found there mean "
        "its live stream is silent (they are applied, and polled every second meanwhile); 0: off",
    )
    unverified_after_s: float = setting(
        60.0,
        "drop a registered replica's placements once neither its live events nor its replay "
        "have answered for this long (checked at the silence polls): nothing vouches for its "
        "cache any more; they come back by replay when it answers; 0: never",
    )
    reap_interval_s: float = setting(2.0, "how often to expire replicas that stopped heartbeating")
    memory_budget_mb: float = setting(
        0.0,
        "Redis memory the index may use, in MiB (its used_memory: Redis dedicated to "
        "kvrouter); above it /health says degraded and the log warns; 0: no budget",
    )
    memory_check_s: float = setting(
        10.0,
        "how often to read Redis's memory use and eviction policy (a policy that evicts "
        "index keys stops the tracker at start and degrades /health later)",
    )
    lease_ttl_s: float = setting(
        0.0,
        "elect the tracker that applies events by a lease in Redis held this long (renewed "
        "every third of it): trackers of one --election wait on standby and take over when "
        "the active one's lease expires; 0: no election (one tracker per Redis)",
    )
    election: str = setting("default", "name of the election trackers of one fleet share")
    shutdown_timeout_s: float = setting(5.0, "graceful shutdown budget")

    def __post_init__(self) -> None:
        if not self.lease_ttl_s >= 0:
            raise ValueError("lease_ttl_s must be >= 0")
        if self.lease_ttl_s and not self.redis:
            raise ValueError("lease_ttl_s needs --redis: the lease lives there")
        if not self.election:
            raise ValueError("election must not be empty")
        for spec in self.replica:
            ReplicaSpec.parse(spec)
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.max_replays <= 0:
            raise ValueError("max_replays must be positive")
        if not self.silence_check_s >= 0:
            raise ValueError("silence_check_s must be >= 0")
        if not self.unverified_after_s >= 0:
            raise ValueError("unverified_after_s must be >= 0")
        if not self.memory_budget_mb >= 0:
            raise ValueError("memory_budget_mb must be >= 0")
        if not self.memory_check_s > 0:
            raise ValueError("memory_check_s must be positive")

    @property
    def replica_specs(self) -> list[ReplicaSpec]:
        return [ReplicaSpec.parse(spec) for spec in self.replica]


@dataclass(frozen=True, kw_only=True)
class LookupSettings(LogSettings):
    """``kvrouter lookup``: where is this token sequence cached?"""

    PART = "LOOKUP"

    redis: str = setting(
        "redis://127.0.0.1:6379/0",
        "Redis URL of the shared index (or redis+sentinel://HOST:PORT,.../SERVICE, "
        "redis+cluster://HOST:PORT,...)",
    )
    model: str = setting("default", "model namespace")
    block_size: int = setting(16, "block size of the namespace")
    lora: str | None = setting(None, "LoRA adapter name, if the request used one")
    lookahead_tokens: int = setting(
        0, "tokens after each block that the engines fold into its hash (vLLM 0.33)"
    )
    tokens: str | None = setting(None, "comma-separated token ids")
    tokens_file: str | None = setting(None, "file with token ids (comma/space separated, or JSON)")
