"""The official ``openai`` SDK against the router (real uvicorn) in front of simulated engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from router.service import RouterService
from tests.router.harness import SYSTEM, base_url, engines, router

pytestmark = pytest.mark.timeout(30)
KEY = "sk-router-test"


@pytest.fixture
async def service() -> AsyncIterator[RouterService]:
    async with engines(2) as fleet, router(replica=fleet.specs, api_key=KEY) as running:
        yield running


def _client(service: RouterService, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(service) + "/v1", api_key=key, max_retries=0)


def _messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


async def test_chat_and_completions(service: RouterService) -> None:
    async with _client(service) as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim"]
        first = await client.chat.completions.create(
            model="sim",
            messages=_messages("first"),  # type: ignore[arg-type]
            max_tokens=5,
        )
        assert first.choices[0].finish_reason == "length"
        assert first.usage is not None and first.usage.completion_tokens == 5
        raw = await client.chat.completions.with_raw_response.create(
            model="sim",
            messages=_messages("second"),  # type: ignore[arg-type]
            max_tokens=5,
        )
        second = raw.parse()
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached == int(raw.headers[PREDICTED_HEADER]) > 1000
        assert raw.headers[REPLICA_HEADER] in ("replica-0", "replica-1")

        completion = await client.completions.create(model="sim", prompt=SYSTEM, max_tokens=3)
        assert completion.object == "text_completion"
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        assert completion.choices[0].text


async def test_streaming(service: RouterService) -> None:
    async with _client(service) as client:
        stream = await client.chat.completions.create(
            model="sim",
            messages=_messages("stream"),  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        assert all(chunk.usage is None for chunk in chunks)  # the router's usage chunk stripped
        assert chunks[-1].choices[0].finish_reason == "length"

        stream = await client.chat.completions.create(
            model="sim",
            messages=_messages("stream"),  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 6
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens > 1000

        pieces = await client.completions.create(
            model="sim", prompt="tell me", max_tokens=4, stream=True
        )
        texts = [piece.choices[0].text async for piece in pieces if piece.choices]
        assert "".join(texts)


async def test_errors_are_openai_errors(service: RouterService) -> None:
    async with _client(service) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(
                model="nope",
                messages=_messages("x"),  # type: ignore[arg-type]
            )
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model="sim", messages=[])
        assert bad.value.param == "messages"
    async with _client(service, key="sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
