"""The simulated engine's OpenAI-compatible HTTP app, shaped like vLLM's: routes and errors.

:func:`create_app` serves the route handlers of :mod:`publishers.handlers` (generation,
tokenization, operations, the simulation-only probe) and ``/metrics`` (vLLM's metric names).
Every response carries ``X-Request-Id`` (the client's, if sent); bodies above the limit are
refused (413) before anything reads them; every error, Starlette's 404 / 405 included, is
answered in vLLM's shape.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from publishers import protocol as wire
from publishers.engine import SimulatedEngine
from publishers.handlers import EngineHandlers
from publishers.metrics import ServerMetrics
from publishers.protocol import RequestError
from publishers.serving import RequestIdMiddleware
from tracker.core.tokens import Tokenizer
from tracker.framework.errors import TokenizationError
from tracker.framework.http import (
    BodyLimitMiddleware,
    Handler,
    answer_errors,
    content_type_refusal,
    http_error_handler,
    metrics_endpoint,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES: Final = 32 << 20


def _openai_errors(handler: Handler) -> Handler:
    """``handler`` for a JSON body (vLLM reads one only when declared so, or not declared),
    with every error answered in vLLM's shape (a bug's without details)."""

    async def checked(request: Request) -> Response:
        refusal = content_type_refusal(request.headers.get("content-type"))
        if refusal is not None:
            raise RequestError(refusal)
        return await handler(request)

    return answer_errors(
        checked, _error_response, expected=(RequestError, TokenizationError), log=logger
    )


def _error_response(exc: Exception) -> Response:
    """vLLM's error response to ``exc`` (a tokenizer's refusal is a 400, a bug a bare 500)."""
    if isinstance(exc, RequestError):
        return wire.error_response(exc)
    if isinstance(exc, TokenizationError):
        return wire.error_response(RequestError(str(exc)))
    return wire.error_response(RequestError("internal error", 500))


def _http_error(detail: str, status: int, headers: Mapping[str, str] | None) -> Response:
    """Starlette's 404 / 405 in vLLM's error shape instead of plain text."""
    response = wire.json_response(wire.error_body(detail, status), status)
    response.headers.update(headers or {})
    return response


def create_app(
    engine: SimulatedEngine,
    tokenizer: Tokenizer,
    *,
    model: str,
    registry: CollectorRegistry,
    max_model_len: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    engine_id: str | None = None,
    adapters: Sequence[str] = (),
) -> Starlette:
    """The OpenAI-compatible app around a started ``engine``.

    :param tokenizer: turns messages and prompts into the engine's token ids.
    :param model: the served model name; requests naming another model get a 404.
    :param registry: where the vLLM-named metrics are registered (served on ``/metrics``).
    :param max_model_len: longest prompt + output; default (and upper bound): the engine's.
    :param max_body_bytes: larger request bodies are refused (413) before anything reads them.
    :param engine_id: named in every response's ``X-Kvrouter-Engine`` header (benchmarks).
    :param adapters: LoRA adapters served beside ``model``, each under its own name (its
        blocks are hashed, and published, with the adapter's name, as vLLM does).
    """
    config = engine.config
    # the engine's own limit (its max_model_len, at most its KV cache) always applies
    engine_limit = config.max_model_len or config.num_blocks * config.block_size
    limit = min(max_model_len, engine_limit) if max_model_len else engine_limit
    recorder = ServerMetrics(
        registry,
        engine.stats,
        model=model,
        engine_index=config.data_parallel_rank,
        cache_config={
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(config.num_blocks),
            "enable_prefix_caching": "True",
        },
    )
    server = EngineHandlers(engine, tokenizer, model, limit, recorder, adapters=tuple(adapters))

    def post(path: str, handler: Handler) -> Route:
        return Route(path, _openai_errors(handler), methods=["POST"])

    routes: Sequence[Route] = [
        post("/v1/chat/completions", server.chat),
        post("/v1/completions", server.completions),
        post("/v1/chat/completions/render", server.render_chat),
        post("/v1/completions/render", server.render_completion),
        post("/tokenize", server.tokenize),
        post("/detokenize", server.detokenize),
        post("/reset_prefix_cache", server.reset_prefix_cache),
        post("/kvrouter/probe", server.probe),
        Route("/v1/models", server.models),
        Route("/health", server.health),
        Route("/metrics", metrics_endpoint(registry)),
    ]
    handlers = {HTTPException: http_error_handler(_http_error)}
    app = Starlette(routes=list(routes), exception_handlers=handlers)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=max_body_bytes,
        error=lambda message: msgspec.json.encode(wire.error_body(message, 413)),
    )
    app.add_middleware(RequestIdMiddleware, engine_id=engine_id)
    return app
