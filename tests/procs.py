"""Real processes for tests: a redis-server on a free loopback port, port helpers."""

from __future__ import annotations

from bench.procs import RedisServer, free_port, free_ports, wait_for_port

__all__ = ["RedisServer", "free_port", "free_ports", "wait_for_port"]
