"""Real processes for tests: a redis-server on a free loopback port, port helpers."""

from __future__ import annotations

import socket

from bench.procs import RedisServer, free_port, wait_for_port

__all__ = ["RedisServer", "free_port", "free_ports", "wait_for_port"]


def free_ports(count: int) -> int:
    """A first port such that ``count`` consecutive loopback ports are free."""
    for _ in range(50):
        first = free_port()
        if first + count > 65_536:
            continue
        socks = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no run of free ports")
