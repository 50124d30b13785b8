"""Engine addresses as gateways name them (``ip:port``), and the replicas behind them.

The registry holds each engine's serving URL (the vLLM plugin registers the pod's address,
``http://$(POD_IP):8000``); a gateway routes to ``host:port`` of that URL, and names
endpoints the same way in its subset hint and in the endpoint that served a request.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from router.fleet.replicas import Replica, ReplicaSet

logger = logging.getLogger(__name__)


def address_of(url: str) -> str:
    """``http://10.0.0.7:8000/`` -> ``10.0.0.7:8000`` (IPv6 in brackets; the scheme's port
    when the URL names none)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split(address: str) -> tuple[str, str]:
    """An endpoint as a gateway wrote it (``ip:port``, ``ip``, ``[v6]:port``, ``v6``) as
    ``(host, port)``; the port is ``""`` when none is given."""
    text = address.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host.lower(), rest.removeprefix(":")
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host.lower(), port
    return text.lower(), ""  # a bare IPv4 address or host name, or a bare IPv6 address


class Endpoints:
    """The replicas of a :class:`~router.fleet.replicas.ReplicaSet` by their address."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._warned: set[str] = set()

    def address(self, replica: Replica) -> str:
        address = address_of(replica.url)
        host = address.rpartition(":")[0].strip("[]")
        if replica.id not in self._warned and not is_ip(host):
            self._warned.add(replica.id)
            logger.warning(
                "a replica's URL names a host, not an IP: gateways route to IP addresses "
                "(register the pod's IP, e.g. http://$(POD_IP):8000)",
                extra={"replica": replica.id, "url": replica.url},
            )
        return address

    def replica_at(self, address: str) -> Replica | None:
        """The replica serving at ``address`` (``ip:port``), if any."""
        wanted = split(address)
        return next((r for r in self.replicas.all() if split(address_of(r.url)) == wanted), None)

    def among(self, addresses: Iterable[str]) -> frozenset[str]:
        """The ids of the replicas at ``addresses``; an entry without a port (a bare IP, as
        the conformance header gives) allows every replica on that host."""
        wanted = {split(a) for a in addresses if a.strip()}
        ids = set()
        for replica in self.replicas.all():
            host, port = split(address_of(replica.url))
            if (host, port) in wanted or (host, "") in wanted:
                ids.add(replica.id)
        return frozenset(ids)


def is_ip(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (not a name)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
