"""The OpenAI request as the decision core takes it: a body decoded and checked for what
routing needs (a 400 names the field at fault), and the usage an engine reports.

Everything else is the engine's to judge: unknown fields and values pass through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from router.errors import BadRequestError

Endpoint = Literal["chat", "completions", "index"]
_RESERVED_TEMPLATE_KEYS: Final = frozenset({"messages", "tools", "add_generation_prompt"})
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """What routing needs from one request body.

    ``prompt`` is the completion prompt (the first one of a batch; ``batch`` counts them);
    ``token_ids`` is only set by the ``/index`` query. ``include_usage`` is whether the
    client itself asked for a usage chunk in its stream. ``session`` is the session the
    request belongs to: OpenAI's ``prompt_cache_key``, else the router's session header.
    """

    endpoint: Endpoint
    body: dict[str, Any]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    messages: list[Any] | None = None
    prompt: str | list[int] | None = None
    token_ids: list[int] | None = None
    batch: int = 1
    cache_salt: str | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    session: str | None = None


def _typed(body: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    """``body[name]`` if absent, null or of type ``kind`` (never int: bools would pass)."""
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise BadRequestError(f"'{name}' must be {what}", param=name)
    return value


def _token_ids(value: Any) -> bool:
    """A non-empty list of token ids, each in [0, 2**32) (block keys hash them as uint32)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in value)
    )


def _prompt(value: Any) -> tuple[str | list[int], int]:
    """The first prompt of a completion request and how many there are."""
    if isinstance(value, str):
        return value, 1
    if _token_ids(value):
        return list(value), 1
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return value[0], len(value)
        if all(_token_ids(p) for p in value):
            return list(value[0]), len(value)
    raise BadRequestError(
        "'prompt' must be a string, a list of strings, a non-empty list of token ids, "
        "or a list of such lists",
        param="prompt",
    )


def _output_limit(body: Mapping[str, Any]) -> int | None:
    """The output limit asked for, if any (the engine, not the router, judges its value)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def parse(raw: bytes, endpoint: Endpoint, session: str | None = None) -> PromptRequest:
    """Decode and check ``raw``, the body of a request to ``endpoint``.

    :param session: the session header's value, if the request has one; the body's
        ``prompt_cache_key`` takes precedence.

    :raises BadRequestError: the body is not JSON, or a field routing needs is missing or of
        the wrong type.
    """
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    model = _typed(body, "model", str, "a string")
    stream = bool(_typed(body, "stream", bool, "a boolean"))
    options = _typed(body, "stream_options", dict, "an object") or {}
    include_usage = bool(_typed(options, "include_usage", bool, "a boolean"))
    salt = _typed(body, "cache_salt", str, "a string")
    add_generation = _typed(body, "add_generation_prompt", bool, "a boolean")
    tools = _typed(body, "tools", list, "an array")
    kwargs = _typed(body, "chat_template_kwargs", dict, "an object") or {}
    cache_key = _typed(body, "prompt_cache_key", str, "a string")
    common: dict[str, Any] = {
        "endpoint": endpoint,
        "body": body,
        "model": model,
        "stream": stream,
        "include_usage": include_usage,
        "cache_salt": salt,
        "add_generation_prompt": True if add_generation is None else add_generation,
        "tools": tools,
        "template_kwargs": {k: v for k, v in kwargs.items() if k not in _RESERVED_TEMPLATE_KEYS},
        "max_tokens": _output_limit(body),
        "session": cache_key or session or None,
    }
    messages = body.get("messages")
    if endpoint == "index":
        given = [name for name in ("messages", "prompt", "token_ids") if name in body]
        if len(given) != 1:
            raise BadRequestError("give exactly one of 'messages', 'prompt' and 'token_ids'")
        if "token_ids" in body:
            if not _token_ids(body["token_ids"]):
                raise BadRequestError(
                    "'token_ids' must be a non-empty list of integers in [0, 2**32)",
                    param="token_ids",
                )
            return PromptRequest(**common, token_ids=list(body["token_ids"]))
        endpoint = "chat" if "messages" in body else "completions"
    if endpoint == "chat":
        if messages is None:
            raise BadRequestError("Missing required parameter: 'messages'.", param="messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("'messages' must be a non-empty array", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequestError(
                    f"'messages[{i}]' must be an object with a string 'role'", param="messages"
                )
        return PromptRequest(**common, messages=messages)
    if body.get("prompt") is None:
        raise BadRequestError("Missing required parameter: 'prompt'.", param="prompt")
    prompt, batch = _prompt(body["prompt"])
    return PromptRequest(**common, prompt=prompt, batch=batch)


def cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` if the engine reported it."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def answer_cached_tokens(data: bytes | bytearray) -> int | None:
    """The cached tokens an engine reported in a whole (not streamed) JSON answer; None when
    it has no usage or is not JSON. Answers without ``"usage"`` are not decoded."""
    if b'"usage"' not in data:
        return None
    try:
        answer = _decode(data)
    except msgspec.DecodeError:
        return None
    return cached_tokens(answer.get("usage")) if isinstance(answer, dict) else None
