"""Loopback ports for local processes: free ones handed out once each, and waiting until one
accepts connections."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path
from typing import Final

_PORT_RANGE_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT: Final = 10_000
_FEW_PORTS: Final = 1_000
_pick = random.SystemRandom()  # not the random module's state, which tests may seed
_handed: set[int] = set()  # ports free_ports gave out: this process never gives one twice
_share = (0, 1)  # (which, of how many): the part of the port range this process picks from


def share_ports(which: int, parts: int) -> None:
    """Pick ports only from part ``which`` of ``parts`` equal parts of the range: processes
    that pick at the same time (test workers) never hand out the same port."""
    if not 0 <= which < parts:
        raise ValueError(f"need 0 <= which < parts, got {which} of {parts}")
    global _share  # noqa: PLW0603 - one setting per process, before any port is picked
    _share = (which, parts)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; its default elsewhere)."""
    try:
        low, high = (int(part) for part in _PORT_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32_768, 60_999
    return low, high


def free_port() -> int:
    """A loopback port nothing listens on right now, outside the ephemeral range where that
    leaves room (:func:`free_ports`).

    The port is handed to a process that binds it later. A port the kernel chose (bind to
    0) comes from the ephemeral range, where any outgoing connection meanwhile may take it
    (docs/deployment.md, "The same topology as local processes").
    """
    return free_ports(1)


def free_ports(count: int) -> int:
    """A first port such that ``count`` consecutive loopback ports are free right now.

    No port is handed out twice by this process: until a process binds the port it was
    given, a bind test here would find it free and hand it to a second one.
    """
    low, high = _ephemeral_ports()
    firsts = [*range(_LOWEST_PORT, low - count + 1), *range(high + 1, 65_537 - count)]
    if len(firsts) < _FEW_PORTS:
        # The ephemeral range covers (nearly) every port. A random one is still far safer than
        # the kernel's choice: bind(0) elsewhere may hand out the very port just released here.
        firsts = list(range(_LOWEST_PORT, 65_537 - count))
    which, parts = _share
    if parts > 1:
        size = len(firsts) // parts
        mine = firsts[which * size : (which + 1) * size]
        firsts = [first for first in mine if first + count - 1 <= mine[-1]]
    for _ in range(100):
        first: int = _pick.choice(firsts)
        run = range(first, first + count)
        if _handed.intersection(run) or not _bindable(run):
            continue
        _handed.update(run)
        return first
    raise RuntimeError(f"no run of {count} free loopback ports")


def _bindable(ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()
    return True


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
    """Return once ``host:port`` accepts connections; :class:`TimeoutError` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")
