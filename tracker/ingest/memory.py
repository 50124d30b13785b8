"""Redis's memory as the tracker watches it: the eviction policy, and use against a budget.

A Redis that evicts keys without a TTL at ``maxmemory`` (an ``allkeys-*`` policy) would drop
index keys with no event to say so, and routers would route on an index silently missing
placements: such a policy refuses the tracker's start, and degrades ``/health`` if it
appears later, as does memory use over ``--memory-budget-mb``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tracker.core.index import BlockIndex
from tracker.framework.errors import ConfigError, IndexUnavailableError
from tracker.ingest.config import TrackerSettings
from tracker.ingest.metrics import TrackerMetrics

if TYPE_CHECKING:
    from tracker.core.redis_recovery import RedisMemory

logger = logging.getLogger(__name__)


@runtime_checkable
class _Metered(Protocol):
    async def memory(self) -> RedisMemory: ...


class MemoryWatch:
    """Reads the index's memory (a Redis index's; other indexes have none to read).

    Args:
        settings: the tracker's settings (``memory_budget_mb``).
        index: the block index.
        metrics: the service's metrics.
    """

    def __init__(
        self, settings: TrackerSettings, index: BlockIndex, metrics: TrackerMetrics
    ) -> None:
        self.settings = settings
        self.index = index
        self.metrics = metrics
        self._memory: RedisMemory | None = None
        self._memory_problem: str | None = None

    @property
    def metered(self) -> bool:
        """Whether the index has memory to watch."""
        return isinstance(self.index, _Metered)

    @property
    def _budget_bytes(self) -> int:
        return int(self.settings.memory_budget_mb * 2**20)

    async def check(self, *, at_start: bool = False) -> None:
        """Read Redis's eviction policy and memory use: a policy that evicts index keys
        refuses the start (routers would route on an index silently missing placements)
        and degrades ``/health`` if it appears later, as does use over the budget."""
        if not isinstance(self.index, _Metered):
            return
        try:
            memory = await self.index.memory()
        except IndexUnavailableError as exc:
            if at_start:
                logger.warning(
                    "cannot read Redis's memory policy yet; checking again later",
                    extra={"error": str(exc)},
                )
            return
        budget = self._budget_bytes
        self._memory = memory
        self.metrics.redis_memory.set(memory.used_bytes)
        self.metrics.memory_budget.set(budget)
        self.metrics.evicting_policy.set(1 if memory.evicts_index else 0)
        problem: str | None = None
        if memory.evicts_index:
            problem = (
                f"Redis maxmemory-policy is {memory.policy}: at maxmemory it evicts index "
                "keys and routers would route on an index silently missing placements; set "
                "'maxmemory-policy noeviction' on a Redis dedicated to kvrouter"
            )
            if at_start:
                raise ConfigError(problem)
        elif budget and memory.used_bytes > budget:
            problem = (
                f"Redis uses {memory.used_bytes / 2**20:.1f} MiB, over the index's budget of "
                f"{self.settings.memory_budget_mb:g} MiB (--memory-budget-mb)"
            )
        if problem != self._memory_problem:
            if problem:
                logger.error(
                    "redis memory out of bounds",
                    extra={"problem": problem, "policy": memory.policy},
                )
            else:
                logger.info("redis memory within bounds again", extra={"policy": memory.policy})
        self._memory_problem = problem

    def status(self) -> dict[str, Any] | None:
        """``/health``'s ``index.memory``; None until the memory was read."""
        if self._memory is None:
            return None
        return {
            "policy": self._memory.policy,
            "used_bytes": self._memory.used_bytes,
            "max_bytes": self._memory.max_bytes,
            "budget_bytes": self._budget_bytes,
            "problem": self._memory_problem,
        }
