"""The simulated engine's OpenAI-compatible HTTP app, shaped like vLLM's: its routes, their
handlers, request ids and vLLM's error shapes.

Generation (``/v1/chat/completions``, ``/v1/completions``, streamed or not, with
``cached_tokens`` from the engine's real prefix reuse), tokenization (``/tokenize``,
``/detokenize``, vLLM's render endpoints; never queued behind simulated compute), operations
(``/v1/models``, ``/health``, ``/reset_prefix_cache``, ``/metrics``) and, simulation only,
``POST /kvrouter/probe`` (:mod:`publishers.sim.probe`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Final

import msgspec
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from publishers.sim import protocol as wire
from publishers.sim.engine import GenerationRequest, RequestStream, SimulatedEngine
from publishers.sim.metrics import ServerMetrics
from publishers.sim.protocol import Head, RequestError
from tracker.core.tokens import Tokenizer
from tracker.framework.errors import TokenizationError
from tracker.framework.http import (
    CLIENT_CLOSED,
    BodyLimitMiddleware,
    ClientWatch,
    Handler,
    answer_errors,
    content_type_refusal,
    http_error_handler,
    metrics_endpoint,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES: Final = 32 << 20
DEFAULT_MAX_TOKENS: Final = 16
THREAD_BODY_BYTES: Final = 4096  # bodies above this are tokenized off the event loop
_RESERVED_TEMPLATE_KEYS: Final = frozenset({"messages", "tools", "add_generation_prompt"})
ENGINE_HEADER: Final = "X-Kvrouter-Engine"


class RequestIdMiddleware:
    """Echo the client's ``X-Request-Id`` (or a fresh one) on every response.

    :param engine_id: also name the engine that answered (``X-Kvrouter-Engine``), so a
        benchmark can tell which engine served a request whatever router sent it there
        (simulation only: vLLM sends no such header).
    """

    def __init__(self, app: ASGIApp, *, engine_id: str | None = None) -> None:
        self.app = app
        self.engine_id = engine_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.append("X-Request-Id", state["request_id"])
                if self.engine_id is not None:
                    headers.append(ENGINE_HEADER, self.engine_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


def _first_set(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


class EngineHandlers:
    """Route handlers around one engine and tokenizer."""

    def __init__(
        self,
        engine: SimulatedEngine,
        tokenizer: Tokenizer,
        model: str,
        max_model_len: int,
        metrics: ServerMetrics,
        *,
        adapters: tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.adapters = frozenset(adapters)
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.created = wire.now()

    # ------------------------------------------------------------------ request parsing

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model and model not in self.adapters:
            raise RequestError(f"The model `{model}` does not exist.", 404, "model")

    def _lora(self, model: str | None) -> str | None:
        """The LoRA adapter a request names (vLLM serves each under its own model name)."""
        return model if model is not None and model in self.adapters else None

    async def _tokenize(self, request: Request, work: Callable[[], list[int]]) -> list[int]:
        if len(await request.body()) > THREAD_BODY_BYTES:
            return await run_in_threadpool(work)
        return work()

    async def _chat_ids(self, request: Request, body: Any) -> list[int]:
        kwargs = {
            k: v
            for k, v in (body.chat_template_kwargs or {}).items()
            if k not in _RESERVED_TEMPLATE_KEYS
        }
        return await self._tokenize(
            request,
            lambda: self.tokenizer.chat_token_ids(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                tools=body.tools,
                **kwargs,
            ),
        )

    async def _prompt_ids(self, request: Request, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, str | list):
            raise RequestError("prompt must be a string or a list of token ids", param="prompt")
        return await self._tokenize(request, lambda: self.tokenizer.prompt_token_ids(prompt))

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """vLLM's context-length checks; the default is small since the engine ignores EOS."""
        if requested is not None and requested < 1:
            raise RequestError(
                f"max_tokens must be at least 1, got {requested}.", param="max_tokens"
            )
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {prompt_len} input tokens. Please reduce the length of the "
                "input messages.",
                param="messages",
            )
        room = self.max_model_len - prompt_len
        if requested is not None and requested > room:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or "
                "completion.",
                param="max_tokens",
            )
        return requested if requested is not None else min(DEFAULT_MAX_TOKENS, room)

    @staticmethod
    def _request_id(request: Request, body: Any, prefix: str) -> str:
        state = request.state
        if "x-request-id" not in request.headers and body.request_id:
            state.request_id = body.request_id
        return f"{prefix}-{state.request_id}"

    @staticmethod
    def _check_n(n: int | None) -> None:
        if n not in (None, 1):
            raise RequestError("n > 1 is not supported by the simulated engine", param="n")

    # ------------------------------------------------------------------ generation

    def _submit(
        self, rid: str, ids: list[int], max_tokens: int, salt: str | None, lora: str | None
    ) -> RequestStream:
        generation = GenerationRequest(rid, ids, max_tokens, lora_name=lora, cache_salt=salt)
        try:
            return self.engine.add_request(generation)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        except RuntimeError as exc:
            raise RequestError(f"engine unavailable: {exc}", 503) from None

    async def chat(self, request: Request) -> Response:
        body = wire.decode(await request.body(), wire.ChatCompletionRequest)
        self._check_model(body.model)
        self._check_n(body.n)
        ids = await self._chat_ids(request, body)
        requested = _first_set(body.max_completion_tokens, body.max_tokens)
        return await self._generate(request, body, ids, requested, chat=True)

    async def completions(self, request: Request) -> Response:
        body = wire.decode(await request.body(), wire.CompletionRequest)
        self._check_model(body.model)
        self._check_n(body.n)
        ids = await self._prompt_ids(request, body.prompt)
        return await self._generate(request, body, ids, body.max_tokens, chat=False)

    async def _generate(
        self, request: Request, body: Any, ids: list[int], requested: int | None, *, chat: bool
    ) -> Response:
        if body.stream_options is not None and not body.stream:
            raise RequestError("Stream options can only be defined when `stream=True`.")
        max_tokens = self._max_tokens(requested, len(ids))
        rid = self._request_id(request, body, "chatcmpl" if chat else "cmpl")
        head = Head(rid, body.model or self.model, wire.now())
        started = time.monotonic()
        stream = self._submit(rid, ids, max_tokens, body.cache_salt, self._lora(body.model))
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._events(
                head, stream, started, max_tokens=max_tokens, include_usage=usage, chat=chat
            )
            return StreamingResponse(events, media_type="text/event-stream")
        tokens = await self._collect(request, stream, started)
        if tokens is None:
            return Response(status_code=CLIENT_CLOSED)  # the client is gone; nobody reads this
        text = self.tokenizer.decode(tokens)
        use = wire.usage(len(ids), len(tokens), stream.cached_tokens)
        build = wire.chat_completion if chat else wire.completion
        return wire.json_response(build(head, text, stream.finish_reason, use))

    async def _collect(
        self, request: Request, stream: RequestStream, started: float
    ) -> list[int] | None:
        """All output ids, or None if the client disconnected first (the request is aborted)."""
        tokens: list[int] = []
        watch = ClientWatch(request.receive)
        try:
            async for step in stream:
                if not tokens:
                    self.metrics.ttft.observe(time.monotonic() - started)
                tokens.extend(step)
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
            return None
        finally:
            watch.close()
            if stream.finish_reason is None:
                self.engine.abort(stream.request_id)
            self.metrics.finished(
                stream.finish_reason, stream.prompt_tokens, len(tokens), time.monotonic() - started
            )
        return tokens

    async def _events(
        self,
        head: Head,
        stream: RequestStream,
        started: float,
        *,
        max_tokens: int,
        include_usage: bool,
        chat: bool,
    ) -> AsyncIterator[bytes]:
        """SSE chunks as vLLM streams them; aborts the request if the client goes away."""
        decoder = self.tokenizer.incremental_decoder()
        received = 0
        ended = False
        try:
            async for step in stream:
                if received == 0:
                    self.metrics.ttft.observe(time.monotonic() - started)
                    if chat:  # vLLM sends the role with the first output, not before
                        yield wire.sse(wire.chat_chunk(head, {"role": "assistant", "content": ""}))
                received += len(step)
                text = decoder.push(step)
                # the engine ignores EOS: max_tokens ends the request (the engine says why)
                last = received >= max_tokens
                finish = (stream.finish_reason or "length") if last else None
                if last:
                    text += decoder.flush()
                    ended = True
                if text or finish:
                    yield wire.sse(self._chunk(head, text, finish, chat=chat))
            if not ended:  # aborted by the engine (e.g. shutdown) after the last tokens
                yield wire.sse(self._chunk(head, decoder.flush(), stream.finish_reason, chat=chat))
            if include_usage:
                use = wire.usage(stream.prompt_tokens, received, stream.cached_tokens)
                kind = "chat.completion.chunk" if chat else "text_completion"
                yield wire.sse(wire.usage_chunk(head, kind, use))
        except Exception as exc:
            # the headers are out: like vLLM, end the stream with an error event
            logger.exception("stream failed", extra={"request_id": stream.request_id})
            yield wire.sse(wire.error_body(f"stream failed: {exc}", 500))
        finally:
            if stream.finish_reason is None:
                self.engine.abort(stream.request_id)
            elapsed = time.monotonic() - started
            self.metrics.finished(stream.finish_reason, stream.prompt_tokens, received, elapsed)
        yield wire.SSE_DONE

    @staticmethod
    def _chunk(head: Head, text: str, finish: str | None, *, chat: bool) -> dict[str, Any]:
        if chat:
            return wire.chat_chunk(head, {"content": text} if text else {}, finish)
        return wire.completion_chunk(head, text, finish)

    # ------------------------------------------------------------------ tokenization

    async def render_chat(self, request: Request) -> Response:
        body = wire.decode(await request.body(), wire.ChatCompletionRequest)
        self._check_model(body.model)
        ids = await self._chat_ids(request, body)
        requested = _first_set(body.max_completion_tokens, body.max_tokens)
        return wire.json_response(self._rendered(request, body, ids, requested, "chatcmpl"))

    async def render_completion(self, request: Request) -> Response:
        body = wire.decode(await request.body(), wire.CompletionRequest)
        self._check_model(body.model)
        ids = await self._prompt_ids(request, body.prompt)
        return wire.json_response([self._rendered(request, body, ids, body.max_tokens, "cmpl")])

    def _rendered(
        self, request: Request, body: Any, ids: list[int], requested: int | None, prefix: str
    ) -> dict[str, Any]:
        return wire.render_result(
            self._request_id(request, body, prefix),
            ids,
            model=body.model,
            max_tokens=self._max_tokens(requested, len(ids)),
            stream=bool(body.stream),
            stream_options=body.stream_options,
            cache_salt=body.cache_salt,
        )

    async def tokenize(self, request: Request) -> Response:
        body = wire.decode(await request.body(), wire.TokenizeRequest)
        self._check_model(body.model)
        if (body.messages is None) == (body.prompt is None):
            raise RequestError("give exactly one of 'prompt' and 'messages'")
        if body.messages is not None:
            if body.add_special_tokens:
                text = self.tokenizer.render_chat(
                    body.messages,
                    add_generation_prompt=body.add_generation_prompt,
                    tools=body.tools,
                )
                ids = self.tokenizer.encode(text, add_special_tokens=True)
            else:
                ids = await self._chat_ids(request, body)
        elif body.add_special_tokens is False and isinstance(body.prompt, str):
            ids = self.tokenizer.encode(body.prompt)
        else:
            ids = await self._prompt_ids(request, body.prompt)
        strs = [self.tokenizer.hf.id_to_token(i) for i in ids] if body.return_token_strs else None
        return wire.json_response(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        body = wire.decode(await request.body(), wire.DetokenizeRequest)
        self._check_model(body.model)
        return wire.json_response({"prompt": self.tokenizer.decode(body.tokens)})

    # ------------------------------------------------------------------ operations

    async def models(self, request: Request) -> Response:
        listing = wire.model_list(
            self.model, self.max_model_len, self.created, adapters=sorted(self.adapters)
        )
        return wire.json_response(listing)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def probe(self, request: Request) -> Response:
        body = wire.decode(await request.body(), wire.ProbeRequest)
        answer = self.engine.probe(body.token_ids, body.cache_salt)
        return Response(msgspec.json.encode(answer), media_type="application/json")

    async def reset_prefix_cache(self, request: Request) -> Response:
        # vLLM answers 200 without checking the outcome; the log says what happened
        done = await self.engine.reset_prefix_cache()
        logger.info("prefix cache reset", extra={"model": self.model, "reset": done})
        return Response(status_code=200)


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
