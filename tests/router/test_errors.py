"""The router's errors map to HTTP statuses and OpenAI-shaped bodies."""

from __future__ import annotations

import pytest

from router.errors import (
    AuthError,
    BadRequestError,
    ModelNotFoundError,
    NoReplicaError,
    PayloadTooLargeError,
    RouterError,
    UpstreamError,
    UpstreamTimeoutError,
    openai_error_body,
    status_of,
)
from tracker.framework.errors import KVRouterError


@pytest.mark.parametrize(
    ("error", "status", "kind", "code"),
    [
        (BadRequestError("bad", param="messages"), 400, "invalid_request_error", None),
        (AuthError("no key"), 401, "invalid_request_error", "invalid_api_key"),
        (ModelNotFoundError("no model"), 404, "invalid_request_error", "model_not_found"),
        (PayloadTooLargeError("big"), 413, "invalid_request_error", "request_too_large"),
        (UpstreamError("boom", replica="r1"), 502, "server_error", "upstream_error"),
        (UpstreamTimeoutError("slow"), 504, "server_error", "upstream_timeout"),
        (NoReplicaError("none"), 503, "server_error", "no_replica_available"),
    ],
)
def test_each_error_has_a_status_and_an_openai_body(
    error: RouterError, status: int, kind: str, code: str | None
) -> None:
    assert isinstance(error, KVRouterError)
    assert status_of(error) == error.status == status
    body = openai_error_body(error)
    assert body == {
        "error": {"message": error.message, "type": kind, "param": error.param, "code": code}
    }


def test_param_and_foreign_errors() -> None:
    assert openai_error_body(BadRequestError("x", param="model"))["error"]["param"] == "model"
    assert isinstance(UpstreamTimeoutError("t"), UpstreamError)
    secret = RuntimeError("password=hunter2 in a traceback")
    assert status_of(secret) == 500
    assert "hunter2" not in str(openai_error_body(secret))
