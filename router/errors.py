"""The router's exception tree; each error knows its HTTP status and OpenAI error shape.

The app turns any :class:`RouterError` into an OpenAI-shaped JSON body in one handler
(:func:`openai_error_body`, :func:`status_of`); lower-layer errors (aiohttp, Redis, tokenizer)
are translated at the boundary that meets them (``raise UpstreamError(...) from exc``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from tracker.framework.errors import KVRouterError


class RouterError(KVRouterError):
    """Base class of every error the router answers a client with."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        """:param param: the request field at fault, as OpenAI reports it (``"messages"``)."""
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequestError(RouterError):
    """The request is malformed or asks for something impossible (400)."""

    status = 400
    type = "invalid_request_error"
    code = None


class AuthError(RouterError):
    """The API key is missing or wrong (401)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFoundError(RouterError):
    """No replica serves the requested model (404)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLargeError(RouterError):
    """The request body exceeds the configured limit (413)."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaTypeError(RouterError):
    """The request body is declared as something other than JSON (415)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class UpstreamError(RouterError):
    """The chosen replica failed, refused the connection or answered garbage (502)."""

    status = 502
    type = "server_error"
    code = "upstream_error"

    def __init__(self, message: str, *, replica: str | None = None) -> None:
        super().__init__(message)
        self.replica = replica


class UpstreamTimeoutError(UpstreamError):
    """The chosen replica did not answer in time (504)."""

    status = 504
    code = "upstream_timeout"


class NoReplicaError(RouterError):
    """No healthy replica can take the request right now (503)."""

    status = 503
    type = "server_error"
    code = "no_replica_available"


class OverloadedError(RouterError):
    """Every replica that could serve the request is full: it is shed (429)."""

    status = 429
    type = "rate_limit_error"
    code = "overloaded"


def status_of(exc: BaseException) -> int:
    """HTTP status for ``exc``: its own for router errors, 500 for anything else."""
    return exc.status if isinstance(exc, RouterError) else 500


def openai_error_body(exc: BaseException) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API answers errors.

    Errors that are not :class:`RouterError` are programming errors: their text may hold
    internals, so clients get a generic message (the handler logs the real one).
    """
    if isinstance(exc, RouterError):
        error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    else:
        error = {
            "message": "internal error",
            "type": RouterError.type,
            "param": None,
            "code": RouterError.code,
        }
    return {"error": error}
