"""The tracker election: one tracker of a fleet applies events, the others wait on standby.

The winner holds a lease (``SET NX PX``) renewed every third of its TTL; each win draws a
fencing number (``INCR``) that every index write carries, so a tracker paused past its lease
cannot write once its successor claimed the partitions
(:meth:`tracker.core.redis_index.RedisIndex.claim_partitions`, refused writes:
:data:`tracker.core.lua.APPLY_FENCED`). The design: docs/architecture.md.
"""

from __future__ import annotations

import os
import secrets
import socket

import redis.asyncio as redis

from tracker.core import keys as schema
from tracker.core import lua
from tracker.core.redis_client import redis_call


class TrackerLease:
    """This tracker's side of one election.

    :param client: the index's Redis client.
    :param election: the election's name (trackers of one fleet share it).
    :param ttl_s: how long a lease lasts without renewal.
    :param holder: this tracker's id in the lease (default: host, pid and a random suffix).
    """

    def __init__(
        self, client: redis.Redis, election: str, ttl_s: float, holder: str | None = None
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client = client
        self.election = election
        self.ttl_s = ttl_s
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.lease_key, self.fence_key = schema.tracker_lease(election)
        self.fence = 0  # this tracker's fencing number while it holds the lease
        self._acquire = client.register_script(lua.LEASE_ACQUIRE)
        self._keep = client.register_script(lua.LEASE_KEEP)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    @property
    def _value(self) -> str:
        return f"{self.fence} {self.holder}"

    async def acquire(self) -> int:
        """Win the lease if it is free (or renew it if this tracker holds it): the fencing
        number, or 0 if another tracker holds it.

        :raises IndexUnavailableError: if Redis does not answer.
        """
        reply = await redis_call(
            "lease",
            self._acquire(keys=[self.lease_key, self.fence_key], args=[self.holder, self._ttl_ms]),
        )
        self.fence = int(reply)
        return self.fence

    async def renew(self) -> bool:
        """Extend the lease; False if this tracker no longer holds it.

        :raises IndexUnavailableError: if Redis does not answer.
        """
        reply = await redis_call(
            "lease", self._keep(keys=[self.lease_key], args=[self._value, self._ttl_ms])
        )
        return bool(reply)

    async def release(self) -> bool:
        """Give the lease up (a graceful stop: a standby takes over at once, not after the
        TTL); False if this tracker did not hold it.

        :raises IndexUnavailableError: if Redis does not answer.
        """
        reply = await redis_call("lease", self._keep(keys=[self.lease_key], args=[self._value, ""]))
        return bool(reply)

    async def holder_now(self) -> str | None:
        """Who holds the lease now (``"<fence> <tracker id>"``), None if nobody.

        :raises IndexUnavailableError: if Redis does not answer.
        """
        value = await redis_call("lease", self.client.get(self.lease_key))
        return None if value is None else bytes(value).decode()
