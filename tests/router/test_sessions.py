"""Session affinity: a session's requests (``prompt_cache_key`` or ``--session-header``) keep
to the replica its last request went to, even when they share no cached block, while the
score says it has room; requests without a key are placed by their prompts alone."""

from __future__ import annotations

import random

import httpx
import pytest

from router.http.proxy import REPLICA_HEADER
from tests.router.harness import base_url, chat, engines, metric, router

pytestmark = pytest.mark.timeout(60)


def _unrelated(rng: random.Random) -> str:
    """A system prompt sharing no block with any other (random words from the start)."""
    return " ".join(f"w{rng.randrange(10**9)}" for _ in range(120))


async def _send(
    client: httpx.AsyncClient,
    system: str,
    headers: dict[str, str] | None = None,
    key: str | None = None,
) -> str:
    body = chat(system, "q") if key is None else chat(system, "q", prompt_cache_key=key)
    answer = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.headers[REPLICA_HEADER]


async def test_a_session_keeps_to_one_replica_by_key_or_header() -> None:
    rng = random.Random(7)
    async with (
        engines(3) as fleet,
        router(replica=fleet.specs, session_header="x-agent") as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        # without a key, prompts that share nothing are spread (the fewest groups first)
        spread = {_unrelated(rng): "" for _ in range(6)}
        for system in spread:
            spread[system] = await _send(client, system)
        assert len(set(spread.values())) == 3
        # with one, every turn goes where the session's first went
        headers = {"x-agent": "session-1"}
        home = {await _send(client, _unrelated(rng), headers=headers) for _ in range(6)}
        assert len(home) == 1
        keyed = {await _send(client, _unrelated(rng), key="session-2") for _ in range(6)}
        assert len(keyed) == 1
        # a prompt cached elsewhere goes there (a hit beats the home), and the session follows
        system, cached = next((p, r) for p, r in spread.items() if r not in home)
        assert await _send(client, system, headers=headers) == cached
        assert await _send(client, _unrelated(rng), headers=headers) == cached
        page = (await client.get("/metrics")).text
        name = "kvrouter_router_session_requests_total"
        assert metric(page, name, outcome="new") == 2
        assert metric(page, name, outcome="home") == 11
        assert metric(page, name, outcome="moved") == 1
