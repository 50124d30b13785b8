"""The tracker's subcommands, registered under the ``kvrouter.commands`` entry point group."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

from tracker.core.backends import open_index
from tracker.core.blocks import Namespace, block_keys
from tracker.core.index import describe_match
from tracker.framework.cli import Command
from tracker.framework.errors import ConfigError, IndexUnavailableError
from tracker.ingest.config import LookupSettings, TrackerSettings


def _run_tracker(settings: TrackerSettings) -> int:
    from tracker.ingest.service import run  # noqa: PLC0415 - keep `kvrouter --help` light

    return run(settings)


def parse_token_ids(text: str) -> list[int]:
    """Token ids from ``1,2,3``, ``1 2 3`` or a JSON array."""
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"tokens: bad JSON: {exc}") from None
    else:
        values = [p for p in re.split(r"[,\s]+", text) if p]
    try:
        ids = [int(v) for v in values]
    except (TypeError, ValueError):
        raise ConfigError("tokens: every token id must be an integer") from None
    if any(not 0 <= i < 2**32 for i in ids):
        raise ConfigError("tokens: token ids must be in [0, 2**32)")
    return ids


async def lookup(settings: LookupSettings, tokens: list[int]) -> dict[str, object]:
    """Per replica: matched blocks and tokens for ``tokens`` in the shared index."""
    namespace = Namespace(settings.model, settings.block_size, settings.lora)
    keys = block_keys(tokens, namespace, lookahead=settings.lookahead_tokens)
    index = open_index(settings.redis)
    try:
        matches = await index.lookup(namespace, keys)
    finally:
        await index.close()
    return {
        "model": settings.model,
        "block_size": settings.block_size,
        "tokens": len(tokens),
        "blocks": len(keys),
        "replicas": {
            m.replica: describe_match(m, settings.block_size)
            for m in sorted(matches.values(), key=lambda m: (-m.blocks, m.replica))
        },
    }


def _run_lookup(settings: LookupSettings) -> int:
    if (settings.tokens is None) == (settings.tokens_file is None):
        raise ConfigError("give exactly one of --tokens and --tokens-file")
    if settings.tokens_file is not None:
        try:
            text = Path(settings.tokens_file).read_text()
        except OSError as exc:
            raise ConfigError(f"tokens-file: {exc}") from None
    else:
        text = settings.tokens or ""
    try:
        result = asyncio.run(lookup(settings, parse_token_ids(text)))
    except IndexUnavailableError as exc:
        print(f"kvrouter lookup: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


TRACKER = Command(
    "tracker", "consume vLLM KV events into the block index", TrackerSettings, _run_tracker
)
LOOKUP = Command(
    "lookup", "show which replicas hold a token sequence's blocks", LookupSettings, _run_lookup
)
