"""Request bodies over HTTP: read under a size limit, and what is sent upstream."""

from __future__ import annotations

from typing import Final

import msgspec
from starlette.requests import Request

from router.decide.request import Endpoint, PromptRequest
from router.errors import PayloadTooLargeError, UnsupportedMediaTypeError
from tracker.framework.http import body_limit_message, content_type_refusal, read_limited

PATHS: Final[dict[Endpoint, str]] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
}
_encode = msgspec.json.Encoder().encode


async def read_body(request: Request, limit: int) -> bytes:
    """The JSON request body, or :class:`PayloadTooLargeError` past ``limit`` bytes.

    :raises UnsupportedMediaTypeError: the body is declared as something else than JSON (no
        ``Content-Type`` at all is taken as JSON, as vLLM does).
    """
    refusal = content_type_refusal(request.headers.get("content-type"))
    if refusal is not None:
        raise UnsupportedMediaTypeError(refusal)
    body = await read_limited(request, limit)
    if body is None:
        raise PayloadTooLargeError(body_limit_message(limit))
    return body


def upstream_body(request: PromptRequest, raw: bytes) -> bytes:
    """The body to send upstream: as received, except that a stream always asks for usage.

    The usage chunk carries the engine's ``cached_tokens``, which the router compares with
    its prediction; the proxy strips that chunk again when the client did not ask for it.
    """
    if not request.stream or request.include_usage:
        return raw
    options = request.body.get("stream_options") or {}
    return _encode({**request.body, "stream_options": {**options, "include_usage": True}})
