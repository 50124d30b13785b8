"""``python -m bench.stack``: start the local stack, print where it listens, stop on Ctrl-C.

redis-server, simulated engines (``kvrouter replica``), one tracker, N routers and haproxy in
TCP (L4) mode in front of the routers; with ``--gateway``, N endpoint pickers (``kvrouter
epp``) behind a real Envoy instead; or, with ``--no-redis``, one router with its in-process
tracker and no Redis. Every process logs to its own file in the work directory.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence

from bench.stack.config import StackSettings
from bench.stack.local import LocalStack
from bench.stack.processes import StackError
from tracker.framework.cli import parse_argv


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_argv(StackSettings, argv, prog="python -m bench.stack", description=__doc__)
    stack = LocalStack(settings.config())
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    try:
        stack.start(settings.timeout_s)
        print(json.dumps(stack.layout.describe(), indent=2), flush=True)
        print("stack ready; Ctrl-C stops it", file=sys.stderr, flush=True)
        while not stopping:
            time.sleep(0.2)
    except StackError as exc:
        print(f"bench.stack: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        codes = stack.stop()
    print(f"stopped: {codes}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
