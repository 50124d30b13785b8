"""Open the block index that a URL names: the one place every part decides between backends.

No URL gives the in-process :class:`~tracker.core.memory_index.MemoryIndex`; a Redis URL of any form
that :mod:`tracker.core.redis_client` accepts gives the shared
:class:`~tracker.core.redis_index.RedisIndex`. Redis is imported only when a Redis URL is
opened, so commands that never use it start light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, overload

from tracker.core.index import BlockIndex
from tracker.core.memory_index import MemoryIndex
from tracker.framework.errors import ConfigError
from tracker.framework.settings import redact_url

if TYPE_CHECKING:
    from tracker.core.redis_index import RedisIndex

REDIS_SCHEMES: Final = (
    "redis",
    "rediss",
    "unix",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
)
"""URL schemes of the shared index: one server, a Sentinel-monitored primary, a cluster."""


@overload
def open_index(url: None, *, timeout_s: float = ...) -> MemoryIndex: ...
@overload
def open_index(url: str, *, timeout_s: float = ...) -> RedisIndex: ...
@overload
def open_index(url: str | None, *, timeout_s: float = ...) -> BlockIndex: ...
def open_index(url: str | None, *, timeout_s: float = 2.0) -> BlockIndex:
    """The index at ``url``: a fresh :class:`~tracker.core.memory_index.MemoryIndex` for ``None``,
    otherwise the shared index of :meth:`tracker.core.redis_index.RedisIndex.from_url`, which
    connects on first use.

    The caller owns the index and closes it (``await index.close()``).

    :param timeout_s: socket and connect timeout of every Redis connection.
    :raises ConfigError: if ``url`` is not a Redis URL, or a malformed one.
    """
    if url is None:
        return MemoryIndex()
    scheme, separator, _ = url.partition("://")
    if not separator or scheme.lower() not in REDIS_SCHEMES:
        expected = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
        raise ConfigError(f"not a Redis URL: {redact_url(url)!r} (expected {expected})")
    from tracker.core.redis_index import RedisIndex  # noqa: PLC0415 - redis only when used

    return RedisIndex.from_url(url, timeout_s=timeout_s)
