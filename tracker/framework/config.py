"""Settings every kvrouter process shares: logging, and the event loop of a long-running one."""

from __future__ import annotations

from dataclasses import dataclass

from tracker.framework.lifecycle import LOOPS
from tracker.framework.settings import Settings, setting


@dataclass(frozen=True, kw_only=True)
class LogSettings(Settings):
    """Logging options every command shares."""

    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("text", "log format", choices=("text", "json"))


@dataclass(frozen=True, kw_only=True)
class ServiceSettings(LogSettings):
    """Options of every long-running process (tracker, router, replicas)."""

    loop: str = setting(
        "auto",
        "event loop: auto (uvloop when installed, as uvicorn picks), uvloop or asyncio",
        choices=LOOPS,
    )
