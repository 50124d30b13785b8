"""Server-sent events passing through the router: split at event boundaries, read the usage.

The relay forwards whole events as soon as they are complete, so it can recognise the final
usage chunk (``"choices": []`` plus ``"usage"``), read the engine's ``cached_tokens`` from it,
and drop it when only the router asked for it. Events without ``"usage"`` are never decoded.
A stream whose upstream breaks ends with :func:`error_event` (never a silent truncation).
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from router.decide.request import cached_tokens
from router.errors import openai_error_body

_BOUNDARY: Final = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def error_event(exc: BaseException) -> bytes:
    """The end of a stream that broke after its first byte: an error event, then ``[DONE]``.

    vLLM ends a failed stream the same way; OpenAI clients raise on the ``error`` event, so a
    cut stream cannot pass for a complete answer.
    """
    return b"data: " + _encode(openai_error_body(exc)) + b"\n\ndata: [DONE]\n\n"


class UsageFilter:
    """Cuts a byte stream into SSE events, notes the usage chunk, optionally drops it.

    :param strip_usage: drop the usage-only chunk (the client did not ask for it).
    """

    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: dict[str, Any] | None = None
        self._buffer = b""

    @property
    def cached_tokens(self) -> int | None:
        return cached_tokens(self.usage)

    def feed(self, data: bytes) -> bytes:
        """The complete events in ``buffered + data``, to forward now (maybe ``b""``)."""
        if not self._buffer and data.endswith(b"\n\n") and b'"usage"' not in data:
            return data  # whole events, none to read: the common chunk, forwarded as it is
        self._buffer += data
        end = 0
        out: list[bytes] = []
        for match in _BOUNDARY.finditer(self._buffer):
            event = self._buffer[end : match.end()]
            end = match.end()
            if self._keep(event):
                out.append(event)
        self._buffer = self._buffer[end:]
        return b"".join(out)

    def flush(self) -> bytes:
        """Whatever trails the last complete event (a stream cut short)."""
        rest, self._buffer = self._buffer, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        if b'"usage"' not in event:
            return True
        payload = b"".join(
            line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")
        )
        try:
            chunk = _decode(payload)
        except msgspec.DecodeError:
            return True
        if not isinstance(chunk, dict) or not isinstance(chunk.get("usage"), dict):
            return True
        self.usage = chunk["usage"]
        return not (self.strip_usage and chunk.get("choices") == [])
