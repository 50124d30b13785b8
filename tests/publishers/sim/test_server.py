"""The simulated engine's OpenAI server under a real uvicorn, driven by httpx and the openai SDK."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from publishers.sim.engine import EngineConfig, SimulatedEngine
from publishers.sim.server import create_app
from tracker.core.tokens import Tokenizer
from tracker.framework.http import HTTPServer, bind

MODEL = "sim-model"
SYSTEM = "You are a careful assistant. " * 12  # a long shared prefix: many full blocks
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Tell me about routing."},
]


@dataclass
class Served:
    url: str
    engine: SimulatedEngine
    tokenizer: Tokenizer
    registry: CollectorRegistry
    http: httpx.AsyncClient
    sdk: openai.AsyncOpenAI

    async def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return await self.http.post(path, json=body, **kwargs)


ServeFactory = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve() -> AsyncIterator[ServeFactory]:
    """Factory: an engine (100x faster than real) + app under uvicorn on a free port."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def factory(
        max_model_len: int | None = None, engine_id: str | None = None, **config: Any
    ) -> Served:
        engine = SimulatedEngine(EngineConfig(**{"time_scale": 0.01, **config}))
        await engine.start()
        tokenizer = Tokenizer.builtin()
        registry = CollectorRegistry()
        app = create_app(
            engine,
            tokenizer,
            model=MODEL,
            registry=registry,
            max_model_len=max_model_len,
            engine_id=engine_id,
        )
        server = HTTPServer(app, bind("127.0.0.1", 0), shutdown_timeout_s=1)
        await server.start()
        url = f"http://127.0.0.1:{server.port}"
        http = httpx.AsyncClient(base_url=url, timeout=10)
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        async def cleanup() -> None:
            await sdk.close()
            await http.aclose()
            await server.stop()
            await engine.stop()

        cleanups.append(cleanup)
        return Served(url, engine, tokenizer, registry, http, sdk)

    yield factory
    for cleanup in reversed(cleanups):
        await cleanup()


@pytest.fixture
async def served(serve: ServeFactory) -> Served:
    return await serve()


async def until(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


async def test_chat_completion_through_the_sdk(served: Served) -> None:
    out = await served.sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=7,  # type: ignore[arg-type]
    )
    prompt_ids = served.tokenizer.chat_token_ids(MESSAGES)
    assert out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-")
    assert out.model == MODEL
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == len(prompt_ids) + 7
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0


async def test_streaming_chat_matches_the_non_streaming_answer(served: Served) -> None:
    whole = await served.sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=12,  # type: ignore[arg-type]
    )
    stream = await served.sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # same prompt, same synthetic tokens: deterministic like greedy decoding
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens_details is not None


async def test_raw_sse_framing(served: Served) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    async with served.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join([part async for part in response.aiter_text()])
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in parsed[-1]  # only with stream_options.include_usage


async def test_completions_streaming_and_not(served: Served) -> None:
    prompt = "The router keeps requests with a shared prefix together. " * 3
    whole = await served.sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(served.tokenizer.prompt_token_ids(prompt))
    stream = await served.sdk.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    # token ids pass straight through, a batch of one is accepted
    ids = await served.post("/v1/completions", {"prompt": [[72, 105, 33]], "max_tokens": 2})
    assert ids.status_code == 200
    assert ids.json()["usage"]["prompt_tokens"] == 3


async def test_cached_tokens_report_the_engines_prefix_reuse(served: Served) -> None:
    first = await served.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    other = [MESSAGES[0], {"role": "user", "content": "Something else entirely."}]
    hits_before = served.engine.stats().prefix_cache_hits
    second = await served.post("/v1/chat/completions", {"messages": other, "max_tokens": 2})
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    a, b = served.tokenizer.chat_token_ids(MESSAGES), served.tokenizer.chat_token_ids(other)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert cached == common // 16 * 16 > 0
    assert served.engine.stats().prefix_cache_hits - hits_before == cached


async def test_metrics_use_vllms_names(served: Served) -> None:
    await served.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    await served.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    response = await served.http.get("/metrics")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        (sample,) = families[name].samples
        assert sample.labels == {"model_name": MODEL, "engine": "0"} and sample.value == 0
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    samples = {s.name: s.value for f in families.values() for s in f.samples}
    stats = served.engine.stats()
    assert samples["vllm:prefix_cache_queries_total"] == stats.prefix_cache_queries > 0
    assert samples["vllm:prefix_cache_hits_total"] == stats.prefix_cache_hits > 0
    assert samples["vllm:time_to_first_token_seconds_count"] == 2
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    (success,) = families["vllm:request_success"].samples
    assert success.labels["finished_reason"] == "length" and success.value == 2
    assert samples["vllm:generation_tokens_total"] == 4


async def test_errors_are_openai_shaped(serve: ServeFactory) -> None:
    served = await serve(max_model_len=300)
    with pytest.raises(openai.NotFoundError):
        await served.sdk.chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
    cases: list[tuple[dict[str, Any] | bytes, int, str]] = [
        ({"model": "nope", "messages": MESSAGES}, 404, "does not exist"),
        (b"{not json", 400, "JSON"),
        ({"messages": MESSAGES, "max_tokens": "many"}, 400, "max_tokens"),
        ({"messages": "hi"}, 400, "messages"),
        ({"max_tokens": 3}, 400, "messages"),
        ({"messages": MESSAGES, "n": 2}, 400, "n > 1"),
        ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "stream"),
        ({"messages": MESSAGES, "max_tokens": 0}, 400, "at least 1"),
        ({"messages": MESSAGES, "max_tokens": 250}, 400, "maximum context length"),
        ({"messages": [{"role": "user", "content": "x" * 400}]}, 400, "maximum context length"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url"),
    ]
    for body, status, fragment in cases:
        if isinstance(body, bytes):
            response = await served.http.post("/v1/chat/completions", content=body)
        else:
            response = await served.post("/v1/chat/completions", body)
        assert response.status_code == status, body
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == status and fragment in error["message"], error
    bad_prompt = await served.post("/v1/completions", {"prompt": {"text": "x"}})
    assert bad_prompt.status_code == 400
    out_of_vocab = await served.post("/v1/completions", {"prompt": [10**6]})
    assert "vocabulary" in out_of_vocab.json()["error"]["message"]
    # a KV cache smaller than the asked max_model_len bounds the context
    small = await serve(num_blocks=4, max_model_len=1000)
    too_big = await small.post("/v1/completions", {"prompt": "y" * 200, "max_tokens": 1})
    assert too_big.status_code == 400
    assert "maximum context length is 64" in too_big.json()["error"]["message"]


async def test_tokenize_and_render_give_the_engines_ids(served: Served) -> None:
    chat_ids = served.tokenizer.chat_token_ids(MESSAGES)
    tokenized = (await served.post("/tokenize", {"model": MODEL, "messages": MESSAGES})).json()
    assert tokenized == {
        "count": len(chat_ids),
        "max_model_len": 4096 * 16,
        "tokens": chat_ids,
        "token_strs": None,
    }
    prompt = (await served.post("/tokenize", {"prompt": "héllo"})).json()
    assert prompt["tokens"] == served.tokenizer.prompt_token_ids("héllo")
    rendered = (await served.post("/v1/chat/completions/render", {"messages": MESSAGES})).json()
    assert rendered["token_ids"] == chat_ids
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["sampling_params"]["max_tokens"] == 16
    assert {"features", "model", "stream", "cache_salt", "priority"} <= set(rendered)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
    (completion,) = (await served.post("/v1/completions/render", body)).json()
    assert completion["token_ids"] == served.tokenizer.prompt_token_ids("abc")
    strs = (await served.post("/tokenize", {"prompt": "ab", "return_token_strs": True})).json()
    assert strs["token_strs"] == ["a", "b"]
    text = (await served.post("/detokenize", {"tokens": [104, 105]})).json()
    assert text == {"prompt": "hi"}
    neither = await served.post("/tokenize", {"model": MODEL})
    assert neither.status_code == 400


async def test_large_prompts_are_tokenized_off_the_event_loop(served: Served) -> None:
    huge = {"prompt": "word " * 2_000_000}
    slow = asyncio.create_task(served.post("/tokenize", huge))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    assert (await served.http.get("/health")).status_code == 200
    assert time.monotonic() - started < 0.5
    assert (await slow).json()["count"] == 10_000_000


async def test_operations_endpoints(served: Served) -> None:
    assert (await served.http.get("/health")).status_code == 200
    models = (await served.http.get("/v1/models")).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["object"], card["owned_by"], card["root"]) == (
        MODEL,
        "model",
        "vllm",
        MODEL,
    )
    sdk_models = [m.id async for m in served.sdk.models.list()]
    assert sdk_models == [MODEL]
    await served.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert (await served.http.post("/reset_prefix_cache")).status_code == 200
    again = await served.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_request_ids(served: Served) -> None:
    given = await served.post(
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 1},
        headers={"X-Request-Id": "abc-123"},
    )
    assert given.headers["x-request-id"] == "abc-123"
    assert given.json()["id"] == "chatcmpl-abc-123"
    in_body = await served.post(
        "/v1/completions", {"prompt": "x", "max_tokens": 1, "request_id": "body-7"}
    )
    assert in_body.headers["x-request-id"] == "body-7"
    assert in_body.json()["id"] == "cmpl-body-7"
    generated = await served.http.get("/health")
    assert len(generated.headers["x-request-id"]) == 32
    error = await served.post("/v1/completions", {"prompt": 3})
    assert error.status_code == 400 and "x-request-id" in error.headers


async def test_the_engine_names_itself_and_its_cache_size(serve: ServeFactory) -> None:
    named = await serve(engine_id="replica-7", num_blocks=300)
    answer = await named.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert answer.headers["x-kvrouter-engine"] == "replica-7"
    page = (await named.http.get("/metrics")).text
    assert 'num_gpu_blocks="300"' in page and "vllm:cache_config_info{" in page
    anonymous = await serve()
    answer = await anonymous.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert "x-kvrouter-engine" not in answer.headers


async def test_client_disconnect_aborts_the_request(serve: ServeFactory) -> None:
    served = await serve(time_scale=0.05)
    body = {"messages": MESSAGES, "max_tokens": 5000, "stream": True}
    async with served.http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for _ in response.aiter_lines():
            break  # first chunk arrived; hang up
    # 5000 decode steps would take seconds; the abort frees the engine at once
    await until(lambda: served.engine.stats().num_requests_running == 0, within=1)
    assert served.engine.stats().num_requests_waiting == 0
    # a non-streaming client that gives up is noticed too
    slow = {"messages": MESSAGES, "max_tokens": 5000}
    with pytest.raises(httpx.ReadTimeout):
        await served.post("/v1/chat/completions", slow, timeout=0.3)
    await until(lambda: served.engine.stats().num_requests_running == 0, within=1)
