"""The steady workload of the fault drills, and how each of its requests ended.

``clients`` concurrent clients send chat requests through the stack's entry point (haproxy
in front of the routers), one TCP connection per request so that haproxy balances every one
of them. Requests come in a few groups sharing a long system prompt, each with its own
question; half of them stream (with ``stream_options.include_usage``). Every request ends in
exactly one class:

* ``completed``: the whole answer, ``max_tokens`` tokens, ``finish_reason`` set, and for a
  stream every chunk up to ``[DONE]``;
* ``clean_error``: an HTTP error with an OpenAI error body, or a stream that ends with an
  ``{"error": ...}`` event;
* ``conn_error``: the client's connection failed visibly (refused, reset, a body cut in the
  middle of its HTTP framing) — what an L4 balancer does to connections of a router that
  died; a client library sees an exception and may retry;
* ``lost``: no answer before the deadline (hung), a stream that ended without ``[DONE]`` or
  an error (silently truncated), or an answer of the wrong shape or length;
* ``cancelled``: the client itself hung up (the disconnect drill).

Routing quality is the engines' own verdict: ``usage.prompt_tokens_details.cached_tokens``
over ``prompt_tokens`` of each completed request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import httpx

Outcome = Literal["completed", "clean_error", "conn_error", "lost", "cancelled"]
OUTCOMES: Final[tuple[Outcome, ...]] = (
    "completed",
    "clean_error",
    "conn_error",
    "lost",
    "cancelled",
)
MODEL: Final = "default"
WORDS: Final = ("kv", "cache", "prefix", "router", "block", "event", "replica", "token", "fault")
REPLICA_HEADER: Final = "x-kvrouter-replica"


@dataclass(frozen=True, slots=True)
class Result:
    """One request: what was asked, when, and how it ended (times are ``time.monotonic()``)."""

    n: int
    group: int
    stream: bool
    max_tokens: int
    started: float
    ended: float
    outcome: Outcome
    detail: str = ""
    status: int | None = None
    replica: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    first_byte: float | None = None

    @property
    def latency_s(self) -> float:
        return self.ended - self.started

    @property
    def hit_rate(self) -> float | None:
        if self.outcome != "completed" or not self.prompt_tokens:
            return None
        return (self.cached_tokens or 0) / self.prompt_tokens


def system_prompt(group: int, tokens: int) -> str:
    """About ``tokens`` tokens (the builtin tokenizer is byte-level); groups differ at once."""
    rng = random.Random(group)
    text = f"[group {group}] You answer questions about KV caches. "
    while len(text) < tokens:
        text += rng.choice(WORDS) + " "
    return text[:tokens]


def error_shape_ok(body: Any) -> bool:
    """An OpenAI error object: ``{"error": {"message": str, "type": str, ...}}``."""
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    )


def _cached(usage: Any) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens"), (details.get("cached_tokens") or 0)


@dataclass
class _Stream:
    """What a client read of one SSE stream."""

    done: bool = False
    error: dict[str, Any] | None = None
    finish: str | None = None
    usage: dict[str, Any] | None = None
    after_done: bool = False
    bad: str = ""

    def feed(self, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if self.done:
            self.after_done = True
            return
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self.bad = f"undecodable event {data[:60]!r}"
            return
        if not isinstance(chunk, dict):
            self.bad = "event is not an object"
        elif "error" in chunk:
            self.error = chunk
        else:
            for choice in chunk.get("choices") or ():
                self.finish = choice.get("finish_reason") or self.finish
            if isinstance(chunk.get("usage"), dict):
                self.usage = chunk["usage"]


@dataclass
class Workload:
    """Steady load on ``url`` from ``clients`` concurrent clients until :meth:`stop`.

    :param max_tokens: output lengths to pick from (each request draws one).
    :param deadline_s: a request without an answer this long is lost (hung).
    :param stream_share: share of streamed requests.
    """

    url: str
    clients: int = 6
    groups: int = 12
    prefix_tokens: int = 2048
    max_tokens: Sequence[int] = (8,)
    stream_share: float = 0.5
    deadline_s: float = 20.0
    seed: int = 1
    results: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._ids = itertools.count()
        self._systems = [system_prompt(g, self.prefix_tokens) for g in range(self.groups)]
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None
        self.started_at = 0.0
        self.stopped_at = 0.0

    # ------------------------------------------------------------------ requests

    def body(self, n: int, group: int, *, stream: bool, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": self._systems[group]},
                {"role": "user", "content": f"Question {n}: what happens to block {n * 7}?"},
            ],
            "max_tokens": max_tokens,
        }
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # no keep-alive: haproxy (L4) balances connections, so one per request
            self._client = httpx.AsyncClient(
                base_url=self.url,
                # only the connect is httpx's to time out: past the deadline a request is
                # hung (lost), whatever phase it is in
                timeout=httpx.Timeout(None, connect=5.0),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=0),
            )
        return self._client

    async def send(
        self,
        group: int,
        *,
        stream: bool,
        max_tokens: int,
        answering: asyncio.Future[str | None] | None = None,
    ) -> Result:
        """One request, classified; never raises for what the server or network did.

        :param answering: resolved with the replica (``x-kvrouter-replica``) once the
            response headers arrived (for a stream: the router relays its first chunk), i.e.
            the request is in flight on that replica.
        """
        n = next(self._ids)
        body = self.body(n, group, stream=stream, max_tokens=max_tokens)
        started = time.monotonic()
        base: dict[str, Any] = {
            "n": n,
            "group": group,
            "stream": stream,
            "max_tokens": max_tokens,
            "started": started,
        }
        try:
            async with asyncio.timeout(self.deadline_s):
                fields = await self._exchange(body, stream, max_tokens, answering)
        except TimeoutError:
            fields = {"outcome": "lost", "detail": f"hung past {self.deadline_s:g}s"}
        except httpx.TransportError as exc:
            fields = {"outcome": "conn_error", "detail": type(exc).__name__}
        return Result(**base, ended=time.monotonic(), **fields)

    async def _exchange(
        self,
        body: dict[str, Any],
        stream: bool,
        max_tokens: int,
        answering: asyncio.Future[str | None] | None,
    ) -> dict[str, Any]:
        client = self.client()
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            out: dict[str, Any] = {
                "status": response.status_code,
                "replica": response.headers.get(REPLICA_HEADER),
            }
            if answering is not None and not answering.done():
                answering.set_result(out["replica"])
            if response.status_code != 200 or not stream:
                raw = await response.aread()
                out["first_byte"] = time.monotonic()
                return out | _judge_body(response.status_code, raw, max_tokens)
            seen = _Stream()
            async for line in response.aiter_lines():
                if "first_byte" not in out:
                    out["first_byte"] = time.monotonic()
                seen.feed(line)
            return out | _judge_stream(seen, max_tokens)

    # ------------------------------------------------------------------ steady load

    async def _client_loop(self) -> None:
        while not self._stopping.is_set():
            group = self._rng.randrange(self.groups)
            stream = self._rng.random() < self.stream_share
            max_tokens = self._rng.choice(list(self.max_tokens))
            self.results.append(await self.send(group, stream=stream, max_tokens=max_tokens))

    def start(self) -> None:
        """Start the clients on the running loop."""
        loop = asyncio.get_running_loop()
        self.started_at = time.monotonic()
        self._tasks = [loop.create_task(self._client_loop()) for _ in range(self.clients)]

    async def stop(self) -> None:
        """Let every client finish its request in flight (bounded by the deadline), then stop."""
        self._stopping.set()
        self.stopped_at = time.monotonic()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.deadline_s + 5)
            for task in self._tasks:
                task.cancel()
            results = await asyncio.gather(*self._tasks, return_exceptions=True)
            crashed = [r for r in results if isinstance(r, Exception)]
            if crashed:
                raise crashed[0]
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> Workload:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self.stop()

    # ------------------------------------------------------------------ analysis

    def counts(self, results: Iterable[Result] | None = None) -> dict[str, int]:
        chosen = list(self.results if results is None else results)
        out: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        for result in chosen:
            out[result.outcome] += 1
        out["sent"] = len(chosen)
        return out


def _judge_body(status: int, raw: bytes, max_tokens: int) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        return {"outcome": "lost", "detail": f"{status} with a body that is not JSON"}
    if status >= 400:
        if error_shape_ok(body):
            code = body["error"].get("code")
            return {"outcome": "clean_error", "detail": f"{status} {code}"}
        return {"outcome": "lost", "detail": f"{status} without an OpenAI error body"}
    if status != 200:
        return {"outcome": "lost", "detail": f"unexpected status {status}"}
    usage = body.get("usage") if isinstance(body, dict) else None
    choices = body.get("choices") if isinstance(body, dict) else None
    prompt, cached = _cached(usage)
    if not choices or not isinstance(usage, dict):
        return {"outcome": "lost", "detail": "200 without choices or usage"}
    if usage.get("completion_tokens") != max_tokens or not choices[0].get("finish_reason"):
        return {"outcome": "lost", "detail": f"wrong answer: usage {usage}"}
    return {"outcome": "completed", "prompt_tokens": prompt, "cached_tokens": cached}


def _judge_stream(seen: _Stream, max_tokens: int) -> dict[str, Any]:
    if seen.bad:
        return {"outcome": "lost", "detail": seen.bad}
    if seen.error is not None:
        if error_shape_ok(seen.error):
            return {"outcome": "clean_error", "detail": f"stream {seen.error['error'].get('code')}"}
        return {"outcome": "lost", "detail": "stream error event of the wrong shape"}
    if not seen.done:
        return {"outcome": "lost", "detail": "stream truncated without [DONE] or an error"}
    if seen.after_done:
        return {"outcome": "lost", "detail": "events after [DONE]"}
    prompt, cached = _cached(seen.usage)
    if seen.usage is None or seen.usage.get("completion_tokens") != max_tokens or not seen.finish:
        return {"outcome": "lost", "detail": f"wrong stream: usage {seen.usage}"}
    return {"outcome": "completed", "prompt_tokens": prompt, "cached_tokens": cached}


# ---------------------------------------------------------------------- outcomes


def failures(results: list[Result]) -> list[Result]:
    return [r for r in results if r.outcome not in ("completed", "cancelled")]


def assert_nothing_lost(results: list[Result]) -> None:
    lost = [r for r in results if r.outcome == "lost"]
    assert not lost, [(r.n, r.stream, r.replica, r.detail) for r in lost[:10]]
