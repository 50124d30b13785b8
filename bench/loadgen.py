"""The benchmark's client: replays a workload's arrivals against an OpenAI endpoint and times it.

Every request streams; its :class:`Result` holds when it was sent, its first content chunk
(TTFT) and its end (E2E) in real seconds, its usage's prompt, cached and output tokens, the
engine that served it and the router's decision time. A conversation's later turn follows
the previous answer after ``think_s`` and carries the whole history, and the subagents it
forks follow that answer at once, the turn after them their last answer (closed loop); or
every request goes at its planned time with the planned answers in its history (open loop,
``Conversation.at_s``). A session key goes as ``prompt_cache_key`` and ``x-session-id``, an
agent's id as ``x-agent-id``. ``bypass_share`` of the conversations go straight to an engine,
their subagents with them (docs/benchmarks.md, "Measurements" and "Scenario knobs").
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import msgspec

from bench.workloads import Conversation, Request, Turn, Workload, history, messages, walk
from router.fleet.upstream import KEEPALIVE_EXPIRY_S

REPLICA_HEADER: Final = "x-kvrouter-replica"
ENGINE_HEADER: Final = "x-kvrouter-engine"
DECISION_HEADER: Final = "x-kvrouter-decision-ms"
SESSION_HEADER: Final = "x-session-id"
AGENT_HEADER: Final = "x-agent-id"
MODEL: Final = "default"
_decode = msgspec.json.Decoder().decode


@dataclass(slots=True)
class Result:
    """One request's outcome; times in real seconds (``sent_s`` from the run's start)."""

    conversation: int
    turn: int
    group: int
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    replica: str = ""
    decision_ms: float | None = None
    error: str | None = None
    bypass: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None


def _events(data: bytes) -> list[Any]:
    out = []
    for raw in data.split(b"\n\n"):
        event = raw.strip()
        if event.startswith(b"data: ") and event != b"data: [DONE]":
            try:
                out.append(_decode(event[6:]))
            except msgspec.DecodeError:
                continue
    return out


def _planned_only(turn: Turn) -> str:
    raise ValueError("an open-loop conversation carries its planned answers")


def _answer_text(events: list[Any], raw: bool) -> str:
    parts = []
    for event in events:
        for choice in event.get("choices") or ():
            if raw:
                parts.append(choice.get("text") or "")
            else:
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def request_parts(
    conversation: Conversation, turn: int, chat: list[dict[str, str]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The body and the headers of ``turn`` (``chat``: its messages, unless raw): the session
    key as ``prompt_cache_key`` and ``x-session-id``, the agent's own id as ``x-agent-id``."""
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": conversation.turns[turn].max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if conversation.raw:
        body["prompt"] = conversation.turns[turn].user
    else:
        body["messages"] = chat
    headers = {}
    if conversation.key is not None:
        body["prompt_cache_key"] = conversation.key
        headers[SESSION_HEADER] = conversation.key
    if conversation.agent is not None:
        headers[AGENT_HEADER] = conversation.agent
    return body, headers


class LoadGenerator:
    """Sends one workload through ``url``; :meth:`run` returns every request's :class:`Result`.

    :param time_scale: real seconds per simulated second (the engines' ``--time-scale``).
    :param on_result: called after each request (progress bars).
    :param bypass_urls: / :param bypass_share: outside traffic (module docstring).
    """

    def __init__(
        self,
        url: str,
        *,
        time_scale: float,
        on_result: Callable[[Result], None] | None = None,
        timeout_s: float = 3600.0,
        bypass_urls: Sequence[str] = (),
        bypass_share: float = 0.0,
        seed: int = 1,
    ) -> None:
        if not 0.0 <= bypass_share <= 1.0:
            raise ValueError(f"bypass_share must be in [0, 1], got {bypass_share}")
        if bypass_share and not bypass_urls:
            raise ValueError("bypass_share needs bypass_urls")
        self.url = url
        self.time_scale = time_scale
        self.on_result = on_result
        self.timeout_s = timeout_s
        self.bypass_urls = list(bypass_urls)
        self.bypass_share = bypass_share
        self.seed = seed
        self._started = 0.0

    def target(self, conversation: Conversation) -> str | None:
        """The engine a bypassing conversation goes to, or None (through the router)."""
        if not self.bypass_share:
            return None
        rng = random.Random(f"bypass:{self.seed}:{conversation.id}")
        if rng.random() >= self.bypass_share:
            return None
        return self.bypass_urls[rng.randrange(len(self.bypass_urls))]

    async def run(self, workload: Workload) -> list[Result]:
        # aiohttp: a tenth of httpx's CPU per request, which shares the cores with the stack.
        # Idle connections close before the servers' 5 s keep-alive timeout closes them.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=self.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            self._started = time.monotonic()
            batches = await asyncio.gather(
                *(self._session(client, c) for c in workload.conversations)
            )
        return [result for batch in batches for result in batch]

    async def _sleep_until(self, at_s: float) -> None:
        delay = self._started + at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _session(
        self, client: aiohttp.ClientSession, conversation: Conversation
    ) -> list[Result]:
        """A conversation and its subagents: planned sends (open loop) or each request after
        the answer it follows (closed loop)."""
        engine = self.target(conversation)
        if conversation.at_s:
            return await self._planned(client, conversation, engine)
        await self._sleep_until(conversation.start_s * self.time_scale)
        return await self._conversation(client, conversation, engine, ())

    async def _planned(
        self, client: aiohttp.ClientSession, conversation: Conversation, engine: str | None
    ) -> list[Result]:
        """Open loop: every request at its planned time, whether earlier ones answered or not
        (histories carry the planned answers)."""

        async def send(request: Request) -> Result:
            at_s = conversation.start_s + request.at_s
            await self._sleep_until(at_s * self.time_scale)
            result, _ = await self._send(
                client, request.conversation, request.turn, request.messages, engine
            )
            self._report(result)
            return result

        return list(await asyncio.gather(*(send(r) for r in walk(conversation, _planned_only))))

    async def _conversation(
        self,
        client: aiohttp.ClientSession,
        conversation: Conversation,
        engine: str | None,
        inherited: Sequence[dict[str, str]],
    ) -> list[Result]:
        """Closed loop: each turn after the previous answer and its think time; after a turn
        with a fork, its subagents at once, and the next turn once they have all finished."""
        answers: list[str] = []
        results = []
        for turn in range(len(conversation.turns)):
            if turn:
                await asyncio.sleep(conversation.think_s[turn - 1] * self.time_scale)
            chat = messages(conversation, turn, answers, inherited)
            want = turn + 1 < len(conversation.turns) or any(conversation.forks_after(turn))
            result, answer = await self._send(
                client, conversation, turn, chat, engine, want_text=want
            )
            answers.append(answer)
            results.append(result)
            self._report(result)
            if result.error is not None:
                break  # the history is broken: the rest of the conversation cannot follow
            for fork in conversation.forks_after(turn):
                await asyncio.sleep(fork.think_s * self.time_scale)
                base = history(conversation, turn, answers, inherited)
                batches = await asyncio.gather(
                    *(self._conversation(client, a, engine, base) for a in fork.agents)
                )
                results += [r for batch in batches for r in batch]
        return results

    def _report(self, result: Result) -> None:
        if self.on_result is not None:
            self.on_result(result)

    async def _send(
        self,
        client: aiohttp.ClientSession,
        conversation: Conversation,
        turn: int,
        chat: list[dict[str, str]],
        engine: str | None,
        *,
        want_text: bool = False,
    ) -> tuple[Result, str]:
        path = "/v1/completions" if conversation.raw else "/v1/chat/completions"
        body, headers = request_parts(conversation, turn, chat)
        sent = time.monotonic()
        result = Result(
            conversation.id, turn, conversation.group, sent - self._started, bypass=bool(engine)
        )
        chunks: list[bytes] = []
        try:
            url = (engine or self.url) + path
            async with client.post(url, json=body, headers=headers) as response:
                got = response.headers
                result.replica = got.get(ENGINE_HEADER) or got.get(REPLICA_HEADER) or ""
                decision = got.get(DECISION_HEADER)
                result.decision_ms = float(decision) if decision else None
                if response.status != 200:
                    text = await response.text(errors="replace")
                    result.error = f"HTTP {response.status}: {text[:200]}"
                    return result, ""
                async for chunk in response.content.iter_any():
                    if result.ttft_s is None and b'"choices":[{' in chunk:
                        result.ttft_s = time.monotonic() - sent
                    chunks.append(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result, ""
        result.e2e_s = time.monotonic() - sent
        events = _events(b"".join(chunks))
        usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
        if not isinstance(usage, dict):
            result.error = "no usage chunk in the stream"
            return result, ""
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)
        return result, _answer_text(events, conversation.raw) if want_text else ""
