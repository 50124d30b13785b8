"""The simulated engine's OpenAI-compatible route handlers, shaped like vLLM's.

Generation: ``/v1/chat/completions`` and ``/v1/completions``, streaming (SSE) or not, with
``usage.prompt_tokens_details.cached_tokens`` taken from the engine's real prefix reuse.
Tokenization: ``/tokenize``, ``/detokenize`` and vLLM's render endpoints, answered at once
(never queued behind simulated compute; large prompts are tokenized on a worker thread).
Operations: ``/v1/models``, ``/health``, ``/reset_prefix_cache``. Simulation only, not part
of vLLM: ``POST /kvrouter/probe`` (``{"token_ids": [...], "cache_salt": null}``) answers what
the engine would reuse and how long the prompt would wait right now
(:mod:`publishers.probe`), for the benchmark's oracle policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from publishers import protocol as wire
from publishers.engine import SimulatedEngine
from publishers.generation import GenerationRequest, RequestStream
from publishers.metrics import ServerMetrics
from publishers.protocol import Head, RequestError
from tracker.core.tokens import Tokenizer
from tracker.framework.http import CLIENT_CLOSED, ClientWatch

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS: Final = 16
THREAD_BODY_BYTES: Final = 4096  # bodies above this are tokenized off the event loop
_RESERVED_TEMPLATE_KEYS: Final = frozenset({"messages", "tools", "add_generation_prompt"})


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
