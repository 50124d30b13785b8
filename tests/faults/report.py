"""``python -m tests.faults.report``: the fault drills' table in docs/reliability.md.

With ``--run``, first runs ``pytest tests/faults`` with ``KVROUTER_FAULTS_JSON`` set, so each
drill records its row in the results file (``KVROUTER_SOAK=1`` in the environment runs the
hour-long soak); then, or without ``--run`` from the rows already recorded, rewrites the part
of the document between ``<!-- faults:begin -->`` and ``<!-- faults:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from tests.faults.results import ENV, notes, table

ROOT: Final = Path(__file__).resolve().parents[2]
RESULTS: Final = ROOT / "bench" / "results" / "faults.json"
DOC: Final = ROOT / "docs" / "reliability.md"
BEGIN: Final = "<!-- faults:begin -->"
END: Final = "<!-- faults:end -->"
COMMAND: Final = ".venv/bin/python -m tests.faults.report --run"


def render(data: dict[str, object]) -> str:
    """The generated part of the document: provenance, the table, the notes."""
    rows = data.get("rows")
    if not isinstance(rows, dict) or not rows:
        raise SystemExit("no fault rows recorded: run with --run")
    return (
        f"Measured {data.get('updated', '?')} on {data.get('machine', '?')} with "
        f"`{COMMAND}`; rows in [bench/results/faults.json](../bench/results/faults.json).\n\n"
        f"{table(rows)}\n\n{notes(rows)}"
    )


def rewrite(document: str, generated: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(document):
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} section")
    return pattern.sub(lambda _: f"{BEGIN}\n{generated}\n{END}", document)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.report", description=__doc__)
    parser.add_argument("--run", action="store_true", help="run the drills first")
    parser.add_argument("--results", type=Path, default=RESULTS, help="rows (JSON)")
    parser.add_argument("--doc", type=Path, default=DOC, help="document to update")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.run:
        args.results.unlink(missing_ok=True)
        env = {**os.environ, ENV: str(args.results)}
        command = [sys.executable, "-m", "pytest", "tests/faults"]
        code = subprocess.call([*command, *args.pytest_args], cwd=ROOT, env=env)
        if code != 0:
            print(f"the drills failed (exit {code}); the document is left as it was")
            return code
    data = json.loads(args.results.read_text())
    args.doc.write_text(rewrite(args.doc.read_text(), render(data)))
    print(f"wrote the table of {len(data['rows'])} drills into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
