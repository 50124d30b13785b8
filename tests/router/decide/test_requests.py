"""Request bodies (shape checks, usage injection) and the SSE usage filter; pure."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.decide.request import cached_tokens, parse
from router.errors import BadRequestError
from router.http.body import upstream_body
from router.http.sse import UsageFilter


def _raw(body: object) -> bytes:
    return json.dumps(body).encode()


def test_chat_fields_routing_needs() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "cache_salt": "s",
        "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False, "messages": "dropped"},
        "unknown_field": [1, 2],
    }
    request = parse(_raw(body), "chat")
    assert (request.model, request.stream, request.include_usage) == ("m", True, False)
    assert request.cache_salt == "s"
    assert request.add_generation_prompt is False
    assert request.template_kwargs == {"enable_thinking": False}
    assert request.messages == body["messages"]


@pytest.mark.parametrize(
    ("prompt", "first", "batch"),
    [
        ("text", "text", 1),
        ([1, 2, 3], [1, 2, 3], 1),
        (["a", "b"], "a", 2),
        ([[1], [2, 3]], [1], 2),
    ],
)
def test_completion_prompt_shapes(prompt: object, first: object, batch: int) -> None:
    request = parse(_raw({"prompt": prompt}), "completions")
    assert (request.prompt, request.batch) == (first, batch)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": 1}]}, "messages"),
        ("chat", {"messages": [{"role": "user"}], "tools": {}}, "tools"),
        ("chat", {"messages": [{"role": "user"}], "stream_options": []}, "stream_options"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": "x", "cache_salt": 3}, "cache_salt"),
        ("completions", {"prompt": "x", "prompt_cache_key": 7}, "prompt_cache_key"),
        ("index", {"token_ids": ["a"]}, "token_ids"),
        ("index", {}, None),
    ],
)
def test_bad_shapes_name_the_field(endpoint: str, body: object, param: str | None) -> None:
    with pytest.raises(BadRequestError) as info:
        parse(_raw(body), endpoint)  # type: ignore[arg-type]
    assert info.value.param == param
    assert info.value.status == 400


def test_a_session_is_the_prompt_cache_key_else_the_header() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse(_raw(body), "chat").session is None
    assert parse(_raw(body), "chat", "from-header").session == "from-header"
    keyed = {**body, "prompt_cache_key": "agent-1"}
    assert parse(_raw(keyed), "chat", "from-header").session == "agent-1"
    assert parse(_raw({**body, "prompt_cache_key": ""}), "chat", "").session is None
    # the key is the engine's too: passed on untouched
    assert parse(_raw(keyed), "chat").body["prompt_cache_key"] == "agent-1"


def test_streams_always_ask_upstream_for_usage() -> None:
    raw = _raw({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": False}})
    request = parse(raw, "completions")
    sent = json.loads(upstream_body(request, raw))
    assert sent["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    asked = _raw({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert upstream_body(parse(asked, "completions"), asked) == asked
    plain = _raw({"prompt": "x"})
    assert upstream_body(parse(plain, "completions"), plain) == plain


def test_cached_tokens() -> None:
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 32}}) == 32
    assert cached_tokens({"prompt_tokens_details": None}) is None
    assert cached_tokens(None) is None
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": True}}) is None


CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}\n\n'
USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":40,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = CHUNK + CHUNK + USAGE + DONE


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=8))
def test_usage_filter_is_independent_of_chunking(cuts: list[int]) -> None:
    bounds = [0, *sorted(set(cuts)), len(STREAM)]
    pieces = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    for strip in (True, False):
        usage = UsageFilter(strip_usage=strip)
        out = b"".join(usage.feed(piece) for piece in pieces) + usage.flush()
        assert out == (CHUNK + CHUNK + DONE if strip else STREAM)
        assert usage.cached_tokens == 32


def test_usage_filter_passes_what_it_cannot_read() -> None:
    usage = UsageFilter(strip_usage=True)
    odd = b'data: {"usage": broken\n\n'
    assert usage.feed(odd + b"data: tail-without-boundary") == odd
    assert usage.flush() == b"data: tail-without-boundary"
    assert usage.cached_tokens is None
    crlf = USAGE.replace(b"\n\n", b"\r\n\r\n")
    assert UsageFilter(strip_usage=True).feed(crlf) == b""
