"""Access control of the router: API keys, operator keys, open routes; keys compared in constant
time and never shown (settings descriptions mask them, URL passwords included)."""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from publishers.config import ReplicaSettings
from router.config import RouterSettings
from router.http.auth import KeyCheck
from tests.router.harness import base_url, chat, engines, router
from tracker.ingest.config import LookupSettings, TrackerSettings

pytestmark = pytest.mark.timeout(60)

API, ADMIN = "sk-api-1", "sk-admin-1"
ROUTES: list[tuple[str, str, str, dict[str, Any] | None]] = [
    ("api", "POST", "/v1/chat/completions", chat("s", "u")),
    ("api", "POST", "/v1/completions", {"model": "sim", "prompt": "hi", "max_tokens": 2}),
    ("api", "GET", "/v1/models", None),
    ("admin", "POST", "/index", {"model": "sim", "prompt": "hi"}),
    ("admin", "GET", "/replicas", None),
    ("admin", "GET", "/metrics", None),
    ("open", "GET", "/health", None),
]


async def _status(client: httpx.AsyncClient, method: str, path: str, body: Any, auth: str) -> int:
    headers = {"authorization": auth} if auth else {}
    response = await client.request(method, path, json=body, headers=headers)
    if response.status_code == 401:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
        assert API not in response.text and ADMIN not in response.text
    return response.status_code


async def test_api_keys_and_operator_keys_guard_their_routes(tmp_path: Path) -> None:
    api_file = tmp_path / "api-keys"
    api_file.write_text(f"# one key per line\n{API}\nsk-api-2\n")
    async with (
        engines(1) as fleet,
        router(replica=fleet.specs, api_key_file=str(api_file), admin_key=ADMIN) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        credentials = {
            "none": "",
            "wrong": "Bearer sk-nope",
            "api": f"Bearer {API}",
            "api2": "bearer sk-api-2",  # the scheme is case-insensitive
            "admin": f"Bearer {ADMIN}",
            "basic": f"Basic {API}",
            "prefix": f"Bearer {API[:-1]}",
            "longer": f"Bearer {API}x",
        }
        for scope, method, path, body in ROUTES:
            for name, auth in credentials.items():
                allowed = (
                    scope == "open"
                    or (scope == "api" and name in ("api", "api2"))
                    or (scope == "admin" and name == "admin")
                )
                status = await _status(client, method, path, body, auth)
                assert (status == 401) != allowed, (path, name, status)
                if allowed:
                    assert status == 200, (path, name, status)


async def test_operator_routes_fall_back_to_the_api_key() -> None:
    """Without --admin-key the API key opens the operator routes too (documented default)."""
    async with (
        engines(1) as fleet,
        router(replica=fleet.specs, api_key=API) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        for scope, method, path, body in ROUTES:
            assert await _status(client, method, path, body, f"Bearer {API}") == 200, path
            expected = 200 if scope == "open" else 401
            assert await _status(client, method, path, body, "") == expected, path


def _request(authorization: str) -> Request:
    headers = [(b"authorization", authorization.encode())]
    return Request({"type": "http", "headers": headers, "method": "GET", "path": "/"})


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """hmac.compare_digest against every configured key, whichever matches (or none)."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("router.http.auth.hmac.compare_digest", spy)
    keys = frozenset({b"key-a", b"key-b", b"key-c"})
    check = KeyCheck(keys)
    for given, allowed in [("key-a", True), ("key-c", True), ("key-x", False), ("", False)]:
        calls.clear()
        assert check.allows(_request(f"Bearer {given}")) is allowed
        assert sorted(b for _, b in calls) == sorted(keys), given


def test_descriptions_mask_keys_and_url_passwords() -> None:
    router_settings = RouterSettings(
        api_key="sk-1",
        admin_key="sk-2",
        upstream_api_key="sk-3",
        redis="rediss://user:pa55word@redis.internal:6380/0?ssl_ca_certs=/etc/ca.pem",
    )
    described = repr(router_settings.describe())
    for secret in ("sk-1", "sk-2", "sk-3", "pa55word"):
        assert secret not in described
    assert "rediss://user:***@redis.internal:6380/0" in described
    for settings in (
        TrackerSettings(redis="redis://:pa55word@h:6379/0"),
        ReplicaSettings(redis="redis://:pa55word@h:6379/0"),
        LookupSettings(redis="redis://default:pa55word@h:6379/0"),
    ):
        assert "pa55word" not in repr(settings.describe())
