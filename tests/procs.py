"""Real processes for tests: the ``kvrouter`` executable, a redis-server, port helpers."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from bench.stack.ports import free_port, free_ports, wait_for_port
from bench.stack.redis_servers import RedisServer

__all__ = ["KVROUTER", "RedisServer", "free_port", "free_ports", "kvrouter_env", "wait_for_port"]

KVROUTER: Final = Path(sys.executable).parent / "kvrouter"
"""The ``kvrouter`` console script of the environment that runs the tests."""


def kvrouter_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without ``KVROUTER_*`` variables, plus ``extra``: the
    settings of a ``kvrouter`` process under test come from its arguments, not the shell's."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    return {**clean, **(extra or {})}
