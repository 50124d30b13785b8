"""The OpenAI-compatible wire shapes the simulated engine speaks, as vLLM's server writes them.

Requests are decoded with msgspec (unknown fields ignored, as OpenAI clients send many);
responses are plain dicts in vLLM's field order, so a router or client cannot tell the
simulated engine from a real vLLM by shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Final, TypeVar

import msgspec
from starlette.responses import Response

ERROR_TYPES: Final = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Generation(msgspec.Struct, kw_only=True):
    """Fields every generation request shares."""

    model: str | None = None
    max_tokens: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    ignore_eos: bool | None = None
    request_id: str | None = None


class ChatCompletionRequest(_Generation, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Generation, kw_only=True):
    # str | list[int] | a one-element list of either; checked by the server
    prompt: Any


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: Any = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class ProbeRequest(msgspec.Struct, kw_only=True):
    """``POST /kvrouter/probe`` (simulation only): a prompt's token ids."""

    token_ids: list[TokenId] = msgspec.field(default_factory=list)
    cache_salt: str | None = None


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-shaped error response."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


_encoder = msgspec.json.Encoder()


def json_response(content: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(content), status, media_type="application/json")


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(exc: RequestError) -> Response:
    return json_response(error_body(exc.message, exc.status, exc.param), exc.status)


def sse(content: Any) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + _encoder.encode(content) + b"\n\n"


SSE_DONE: Final = b"data: [DONE]\n\n"
T = TypeVar("T")


def decode(body: bytes, kind: type[T]) -> T:
    """Decode a JSON request body, turning every failure into a 400."""
    if not body.isascii():
        # msgspec skips unknown keys unchecked: invalid UTF-8 there would pass unnoticed
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("invalid JSON body: not UTF-8") from None
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"invalid JSON body: {exc}") from None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Head(msgspec.Struct, frozen=True):
    """What every response object of one request starts with."""

    id: str
    model: str
    created: int

    def fields(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def chat_completion(
    head: Head, text: str, finish: str | None, use: dict[str, Any]
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "reasoning_content": None,
        "tool_calls": [],
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
    }
    return {
        **head.fields("chat.completion"),
        "choices": [choice],
        "usage": use,
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def chat_chunk(head: Head, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    return {**head.fields("chat.completion.chunk"), "choices": [choice]}


def completion(head: Head, text: str, finish: str | None, use: dict[str, Any]) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    return {
        **head.fields("text_completion"),
        "choices": [choice],
        "usage": use,
        "kv_transfer_params": None,
    }


def completion_chunk(head: Head, text: str, finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    choice["stop_reason"] = None
    return {**head.fields("text_completion"), "choices": [choice]}


def usage_chunk(head: Head, kind: str, use: dict[str, Any]) -> dict[str, Any]:
    """The final chunk ``stream_options.include_usage`` asks for: no choices, only usage."""
    return {**head.fields(kind), "choices": [], "usage": use}


def model_list(
    model: str, max_model_len: int, created: int, adapters: Sequence[str] = ()
) -> dict[str, Any]:
    """vLLM's ``/v1/models``: the model, then each LoRA adapter with the model as ``parent``."""
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
    cards = [card]
    for adapter in adapters:
        cards.append({**card, "id": adapter, "root": adapter, "parent": model})
    return {"object": "list", "data": cards}


def render_result(
    rid: str,
    token_ids: list[int],
    *,
    model: str | None,
    max_tokens: int,
    stream: bool,
    stream_options: StreamOptions | None,
    cache_salt: str | None,
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` as the render endpoints return it (sampling params trimmed)."""
    return {
        "request_id": rid,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": {"n": 1, "max_tokens": max_tokens},
        "model": model,
        "stream": stream,
        "stream_options": msgspec.to_builtins(stream_options) if stream else None,
        "cache_salt": cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
    }


def now() -> int:
    return int(time.time())
