"""Replica specs as operators write them: ``ID=tcp://host:5557,replay=tcp://host:5558,url=...``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tracker.framework.errors import ConfigError

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_KEYS = frozenset({"replay", "url", "model", "block_size"})


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """A statically configured replica: id, event endpoint, optional replay endpoint and URL."""

    id: str
    events: str
    replay: str | None = None
    url: str | None = None
    model: str | None = None
    block_size: int | None = None

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        """Parse ``ID=EVENTS[,replay=ENDPOINT][,url=URL][,model=M][,block_size=N]``."""
        head, _, rest = text.strip().partition(",")
        replica_id, eq, events = head.partition("=")
        if not eq or not _ID.match(replica_id) or not events:
            raise ConfigError(
                f"bad replica spec {text!r}: expected "
                "ID=tcp://host:5557[,replay=tcp://host:5558][,url=http://host:8000]"
            )
        _check_endpoint(events, text)
        options: dict[str, str] = {}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq or key not in _KEYS or not value:
                raise ConfigError(f"bad option {part!r} in replica spec {text!r}")
            if key in options:
                raise ConfigError(f"option {key!r} repeated in replica spec {text!r}")
            options[key] = value
        if "replay" in options:
            _check_endpoint(options["replay"], text)
        url = options.get("url")
        if url is not None and not url.startswith(("http://", "https://")):
            raise ConfigError(f"url must be http(s) in replica spec {text!r}")
        block_size = options.get("block_size")
        if block_size is not None and (not block_size.isdigit() or int(block_size) <= 0):
            raise ConfigError(f"block_size must be a positive int in replica spec {text!r}")
        return cls(
            replica_id,
            events,
            options.get("replay"),
            url,
            options.get("model"),
            int(block_size) if block_size else None,
        )


def _check_endpoint(endpoint: str, text: str) -> None:
    scheme, sep, address = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not address:
        raise ConfigError(f"endpoint {endpoint!r} in replica spec {text!r} is not a ZMQ address")
    if scheme == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
            raise ConfigError(
                f"endpoint {endpoint!r} in replica spec {text!r} needs a host and a port"
            )
