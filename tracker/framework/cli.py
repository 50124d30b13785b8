"""The ``kvrouter`` command: subcommands are discovered from the ``kvrouter.commands`` entry points.

Each part (tracker, router, publishers) registers its own commands, so this dispatcher never
imports the router or the publishers.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

from tracker.framework import logs
from tracker.framework.errors import ConfigError
from tracker.framework.settings import Settings

S = TypeVar("S", bound=Settings)


@dataclass(frozen=True)
class Command:
    """A subcommand: its settings class and a ``run(settings) -> exit status`` function."""

    name: str
    help: str
    settings: type[Settings]
    run: Callable[[Any], int]


def load_commands() -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for ep in entry_points(group="kvrouter.commands"):
        try:
            command = ep.load()
        except ImportError as exc:  # a part that failed to install must not hide the others
            print(f"kvrouter: command {ep.name!r} unavailable: {exc}", file=sys.stderr)
            continue
        if isinstance(command, Command):
            commands[command.name] = command
    return dict(sorted(commands.items()))


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    """The ``kvrouter`` argument parser: one subparser per command, flags from its settings."""
    parser = argparse.ArgumentParser(
        prog="kvrouter", description="KV-cache-aware routing for vLLM / SGLang fleets."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands.values():
        command.settings.add_arguments(sub.add_parser(command.name, help=command.help))
    return parser


def parse_argv(
    settings: type[S],
    argv: Sequence[str] | None,
    *,
    prog: str | None = None,
    description: str | None = None,
) -> S:
    """A script's settings from its command line (flags generated from the fields) and the
    environment; a bad flag or value exits with the usage error, as ``kvrouter`` does."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    settings.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return settings.from_args(args, os.environ)
    except ConfigError as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    commands = load_commands()
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    command = commands[args.command]
    del args.command
    try:
        settings = command.settings.from_args(args, os.environ)
    except ConfigError as exc:
        parser.error(f"{command.name}: {exc}")
    logs.configure(getattr(settings, "log_level", "info"), getattr(settings, "log_format", "text"))
    try:
        return command.run(settings)
    except ConfigError as exc:
        print(f"kvrouter {command.name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
