"""A generation request to the simulated engine, and the stream of its output tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

__all__ = ["GenerationRequest", "RequestStream"]


class GenerationRequest(msgspec.Struct):
    """A tokenized generation request."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    lora_name: str | None = None
    cache_salt: str | None = None
    ignore_eos: bool = True


class RequestStream:
    """The output side of one request: token ids per engine step, then the finish reason.

    ``cached_tokens`` is set when the request is first scheduled (prefix-cache hits, in
    tokens); ``finish_reason`` is ``"length"``, ``"abort"`` or ``None`` while running.
    """

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self._chunks: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self._first = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _push(self, tokens: list[int]) -> None:
        self.output_tokens += len(tokens)
        self._chunks.put_nowait(tokens)
        self._first.set()

    def _finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self._chunks.put_nowait(None)
            self._first.set()

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        while (chunk := await self._chunks.get()) is not None:
            yield chunk
        self._chunks.put_nowait(None)  # a later iteration ends at once too

    async def wait_first_token(self) -> None:
        """Return once the first token exists, or the request ended without one."""
        await self._first.wait()
