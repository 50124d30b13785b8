"""The deployment files as tests read them: the compose services and their kvrouter commands."""

from __future__ import annotations

import shlex
from contextlib import redirect_stderr
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml

from tracker.framework.cli import Command, build_parser, load_commands
from tracker.framework.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
# services running the image built from this repository (the others are redis and haproxy)
KVROUTER_SERVICES = sorted(name for name, svc in SERVICES.items() if "build" in svc)


@dataclass(frozen=True)
class Parsed:
    """A service's command, as kvrouter itself would read it."""

    command: Command
    settings: Any


def environment(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.partition("=")[::2] for item in raw)
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def parse_command(argv: list[str], env: dict[str, str]) -> Parsed:
    """``kvrouter ARGV`` with environment ``env``, as ``tracker.framework.cli.main`` reads it."""
    commands = load_commands()
    parser = build_parser(commands)
    errors = StringIO()
    try:
        with redirect_stderr(errors):
            args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"kvrouter {shlex.join(argv)}: {errors.getvalue().strip().splitlines()[-1]}")
    command = commands[args.command]
    del args.command
    return Parsed(command, command.settings.from_args(args, env))


def parsed(name: str) -> Parsed:
    service = SERVICES[name]
    return parse_command([str(a) for a in service["command"]], environment(service))


def of_kind(kind: type[Settings]) -> dict[str, Any]:
    """Settings of every kvrouter service whose command builds ``kind``."""
    out = {}
    for name in KVROUTER_SERVICES:
        settings = parsed(name).settings
        if isinstance(settings, kind):
            out[name] = settings
    return out
