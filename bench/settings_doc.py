"""Render every command's settings as Markdown tables (flags, env vars, defaults, help).

``python -m bench.settings_doc --write README.md`` replaces the text between the
``<!-- settings:begin -->`` and ``<!-- settings:end -->`` markers; ``--check`` exits 1 when
the README is out of date (the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from tracker.framework.cli import load_commands

BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"


def render() -> str:
    out: list[str] = []
    for name, command in load_commands().items():
        settings = command.settings
        out.append(f"#### `kvrouter {name}` — {command.help}\n")
        out.append("| flag | env | default | meaning |")
        out.append("|---|---|---|---|")
        for f in dataclasses.fields(settings):  # type: ignore[arg-type]
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = ""
            shown = "" if default in (None, (), "") else f"`{default}`"
            text = str(f.metadata.get("help", "")).replace("|", "\\|")
            out.append(f"| `{flag}` | `{settings.env_name(f.name)}` | {shown} | {text} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def splice(document: str, table: str) -> str:
    head, sep, rest = document.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"markers {BEGIN} / {END} not found")
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write", type=Path)
    parser.add_argument("--check", type=Path)
    args = parser.parse_args()
    table = render()
    if args.write:
        args.write.write_text(splice(args.write.read_text(), table))
    elif args.check:
        if splice(args.check.read_text(), table) != args.check.read_text():
            print(f"{args.check} settings tables are stale: run scripts/settings-table")
            return 1
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
