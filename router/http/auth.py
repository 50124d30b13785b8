"""Bearer keys of the router's routes: read once, compared in constant time, never logged."""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.requests import Request

from tracker.framework.errors import ConfigError


def load_keys(key: str | None, path: str | None, what: str) -> frozenset[bytes]:
    """The keys given inline and in ``path`` (one per line; blank lines and ``#`` skipped).

    :raises ConfigError: the file cannot be read (the message never holds its content).
    """
    keys: set[str] = set()
    if key and key.strip():
        keys.add(key.strip())
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
            raise ConfigError(f"{what}: cannot read {path}: {reason}") from None
        keys.update(
            line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
        )
        if not keys:
            raise ConfigError(f"{what}: {path} holds no key")
    return frozenset(k.encode() for k in keys)


class KeyCheck:
    """Accepts a request whose ``Authorization: Bearer <key>`` is one of ``keys`` (any if none)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, request: Request) -> bool:
        return self.allows_header(request.headers.get("authorization", ""))

    def allows_header(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header's value carries one of the keys."""
        if not self._keys:
            return True
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        # compare against every key, so the time taken says nothing about which one is close
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        return matched
