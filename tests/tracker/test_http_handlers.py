"""The request-handler plumbing the router and the simulated engines share.

It lives in tracker/framework/http.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from tracker.framework.http import (
    CLIENT_CLOSED,
    BodyLimitMiddleware,
    ClientWatch,
    HTTPServer,
    answer_errors,
    bind,
    body_limit_message,
    content_type_refusal,
    http_error_handler,
    metrics_endpoint,
    read_limited,
)

LIMIT = 10


def client(app: Starlette | BodyLimitMiddleware) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    """A request body sent chunked, without a ``Content-Length``."""
    for part in parts:
        yield part


def scope(headers: Mapping[str, str] | None = None) -> Scope:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "method": "POST", "path": "/", "headers": raw, "query_string": b""}


def messages(*sent: Message) -> tuple[Receive, list[Message]]:
    """An ASGI ``receive`` that hands out ``sent`` in order, and the list of those it handed."""
    pending, handed = list(sent), []

    async def receive() -> Message:
        assert pending, "read past what the client sent"
        handed.append(pending.pop(0))
        return handed[-1]

    return receive, handed


# ---------------------------------------------------------------------------- content types


@pytest.mark.parametrize(
    "declared",
    [
        None,
        "application/json",
        "APPLICATION/JSON",
        " application/json ; charset=utf-8",
        "application/vnd.api+json",
    ],
)
def test_json_and_undeclared_bodies_are_read_as_json(declared: str | None) -> None:
    assert content_type_refusal(declared) is None


@pytest.mark.parametrize(
    "declared", ["text/plain", "text/json", "application/xml", "multipart/form-data; boundary=x"]
)
def test_other_content_types_are_refused_by_name(declared: str) -> None:
    assert content_type_refusal(declared) == (
        f"Unsupported content type {declared!r}: send application/json."
    )


def test_a_refused_content_type_is_quoted_at_most_100_characters_long() -> None:
    refusal = content_type_refusal("text/" + "x" * 500)
    assert refusal == f"Unsupported content type {'text/' + 'x' * 95!r}: send application/json."


# ---------------------------------------------------------------------------- body limit


async def test_a_body_up_to_the_limit_is_read_whole() -> None:
    async def echo(request: Request) -> Response:
        body = await read_limited(request, LIMIT)
        return PlainTextResponse("refused" if body is None else body.decode())

    async with client(Starlette(routes=[Route("/", echo, methods=["POST"])])) as http:
        assert (await http.post("/", content=b"x" * LIMIT)).text == "x" * LIMIT
        assert (await http.post("/", content=chunks(b"ab", b"", b"cd"))).text == "abcd"
        assert (await http.post("/", content=b"x" * (LIMIT + 1))).text == "refused"
        assert (await http.post("/", content=chunks(b"x" * 6, b"x" * 6))).text == "refused"


async def test_a_declared_length_over_the_limit_is_refused_before_any_read() -> None:
    receive, handed = messages()
    request = Request(scope({"content-length": str(LIMIT + 1)}), receive)
    assert await read_limited(request, LIMIT) is None
    assert handed == []


async def test_a_body_over_the_limit_is_left_unread_past_it() -> None:
    receive, handed = messages(
        {"type": "http.request", "body": b"x" * 8, "more_body": True},
        {"type": "http.request", "body": b"x" * 8, "more_body": True},
        {"type": "http.request", "body": b"x" * 8, "more_body": False},
    )
    assert await read_limited(Request(scope(), receive), LIMIT) is None
    assert len(handed) == 2


async def test_a_client_that_leaves_mid_body_is_a_client_disconnect() -> None:
    receive, _ = messages(
        {"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}
    )
    with pytest.raises(ClientDisconnect):
        await read_limited(Request(scope(), receive), LIMIT)


def limited(app: Starlette) -> BodyLimitMiddleware:
    return BodyLimitMiddleware(
        app, max_bytes=LIMIT, error=lambda m: f'{{"refused":"{m}"}}'.encode()
    )


async def test_the_middleware_refuses_an_oversized_body_before_the_app_sees_it() -> None:
    seen: list[bytes] = []

    async def app(request: Request) -> Response:
        seen.append(await request.body())
        return PlainTextResponse("ok")

    async with client(limited(Starlette(routes=[Route("/", app, methods=["POST"])]))) as http:
        assert (await http.post("/", content=b"x" * LIMIT)).text == "ok"
        for body in (b"x" * (LIMIT + 1), chunks(b"x" * 6, b"x" * 6)):
            refused = await http.post("/", content=body)
            assert refused.status_code == 413
            assert refused.json() == {"refused": body_limit_message(LIMIT)}
            assert refused.headers["content-type"] == "application/json"
            assert refused.headers["connection"] == "close"
    assert seen == [b"x" * LIMIT]
    assert body_limit_message(LIMIT) == f"the request body exceeds {LIMIT} bytes"


async def test_the_middleware_hands_the_app_a_client_that_left_mid_body() -> None:
    seen: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(await receive())

    receive, _ = messages(
        {"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}
    )
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    middleware = BodyLimitMiddleware(app, max_bytes=LIMIT, error=lambda m: m.encode())
    await middleware(scope(), receive, send)
    assert seen == [{"type": "http.disconnect"}]
    assert sent == []


# ---------------------------------------------------------------------------- disconnects


async def test_a_client_that_hangs_up_cancels_its_request_once() -> None:
    outcome: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def slow(request: Request) -> Response:
        await request.body()
        watch = ClientWatch(request.receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            outcome.set_result(watch.absorb())
            return Response(status_code=CLIENT_CLOSED)
        finally:
            watch.close()
        return PlainTextResponse("too late")

    server = HTTPServer(Starlette(routes=[Route("/", slow)]), bind("127.0.0.1", 0))
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.get("/", timeout=0.3)
        assert await asyncio.wait_for(outcome, 5) is True
    finally:
        await server.stop()


async def test_an_answered_request_is_not_cancelled_after_its_watch_closes() -> None:
    watches: list[ClientWatch] = []

    async def quick(request: Request) -> Response:
        watch = ClientWatch(request.receive)
        watches.append(watch)
        await asyncio.sleep(0.01)
        watch.close()
        watch.close()  # idempotent
        return PlainTextResponse("ok")

    async with client(Starlette(routes=[Route("/", quick)])) as http:
        assert (await http.get("/")).text == "ok"
    await asyncio.sleep(0.01)
    assert not watches[0].gone
    assert not watches[0].task.cancelled()


async def test_a_cancellation_that_is_not_the_watchs_is_not_absorbed() -> None:
    never = asyncio.Event()
    absorbed: list[bool] = []

    async def receive() -> Message:
        await never.wait()
        return {"type": "http.disconnect"}

    async def request() -> None:
        watch = ClientWatch(receive)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            absorbed.append(watch.absorb())
            raise
        finally:
            watch.close()

    task = asyncio.create_task(request())
    await asyncio.sleep(0.01)
    task.cancel()  # a server shutting down, say
    with pytest.raises(asyncio.CancelledError):
        await task
    assert absorbed == [False]


# ---------------------------------------------------------------------------- answers


async def test_expected_errors_are_answered_quietly_and_bugs_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("tests.answers")

    async def refuse(request: Request) -> Response:
        raise ValueError("no thanks")

    async def crash(request: Request) -> Response:
        raise RuntimeError("secret internals")

    def answer(exc: Exception) -> Response:
        if isinstance(exc, ValueError):
            return JSONResponse({"error": str(exc)}, 400)
        return JSONResponse({"error": "internal error"}, 500)

    routes = [
        Route(f"/{h.__name__}", answer_errors(h, answer, expected=(ValueError,), log=log))
        for h in (refuse, crash)
    ]
    with caplog.at_level(logging.ERROR, logger="tests.answers"):
        async with client(Starlette(routes=routes)) as http:
            refused = await http.get("/refuse")
            assert (refused.status_code, refused.json()) == (400, {"error": "no thanks"})
            assert not caplog.records
            crashed = await http.get("/crash")
    assert (crashed.status_code, crashed.json()) == (500, {"error": "internal error"})
    [record] = caplog.records
    assert (record.name, record.getMessage()) == ("tests.answers", "request failed")
    assert getattr(record, "path", None) == "/crash"
    assert record.exc_info is not None and "secret internals" in str(record.exc_info[1])


async def test_starlettes_own_http_errors_get_the_servers_shape() -> None:
    asked: list[tuple[str, int, Mapping[str, str] | None]] = []

    def answer(detail: str, status: int, headers: Mapping[str, str] | None) -> Response:
        asked.append((detail, status, headers))
        return JSONResponse({"error": detail}, status, headers=headers)

    async def only_post(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[Route("/only", only_post, methods=["POST"])],
        exception_handlers={HTTPException: http_error_handler(answer)},
    )
    async with client(app) as http:
        missing = await http.get("/nope")
        assert (missing.status_code, missing.json()) == (404, {"error": "Not Found"})
        wrong = await http.get("/only")
        assert (wrong.status_code, wrong.json()) == (405, {"error": "Method Not Allowed"})
        assert wrong.headers["allow"] == "POST"
    assert asked == [("Not Found", 404, None), ("Method Not Allowed", 405, {"Allow": "POST"})]


async def test_metrics_are_served_in_prometheus_text_format() -> None:
    registry = CollectorRegistry()
    Counter("kvrouter_test_things", "Things.", registry=registry).inc()
    app = Starlette(
        routes=[
            Route("/metrics", metrics_endpoint(registry)),
            Route("/custom", metrics_endpoint(registry, exposition=lambda r: b"# merged\n")),
        ]
    )
    async with client(app) as http:
        page = await http.get("/metrics")
        assert page.headers["content-type"] == CONTENT_TYPE_LATEST
        assert "kvrouter_test_things_total 1.0" in page.text
        custom = await http.get("/custom")
        assert custom.headers["content-type"] == CONTENT_TYPE_LATEST
        assert custom.text == "# merged\n"
