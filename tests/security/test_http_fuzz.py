"""Fuzz the router (in front of simulated engines) and a simulated engine alone, over real HTTP.

Both run as real ``kvrouter`` processes (uvicorn) with small limits. Requests come from
hypothesis: valid ones drawn from the published OpenAPI descriptions (docs/openapi-*.json),
and invalid ones made from them by one mutation each (a missing required field, a field of
the wrong type, an unknown model, an absurd ``max_tokens``, malformed ``stream_options``,
a body that is not an object, broken or non-UTF-8 JSON, a wrong content type, a body over
``--max-body-bytes``, a prompt over ``--max-prompt-tokens`` / ``--max-model-len``).

Every answer must come within :data:`BOUND_S`; none may be a 5xx; every error must have the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}``; every invalid request must
get a 4xx. At the end neither process may have logged a traceback.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.procs import free_port, free_ports
from tests.router.harness import Process
from tests.security import openapi

pytestmark = pytest.mark.timeout(300)  # one worker runs it all: tests/conftest.py, SERIAL

BOUND_S = 5.0
MAX_BODY = 256 * 1024
MAX_PROMPT_TOKENS = 2048  # the router's limit
MAX_MODEL_LEN = 4096  # the engine's
MODEL = "sim"
LABELS: list[str] = []  # what was sent, to check the mix at the end
ERROR_KEYS = {"message", "type", "param", "code"}
ROUTER_DOC = openapi.load("router")
ENGINE_DOC = openapi.load("engine")
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Stack:
    router: httpx.Client
    engine: httpx.Client
    procs: list[Process]


def _wait_healthy(client: httpx.Client, proc: Process, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.alive, proc.log()
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{proc.args[0]} not healthy; log:\n{proc.log()}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("http-fuzz")
    http, events, replay, port = free_ports(2), free_ports(2), free_ports(2), free_port()
    replicas = Process(
        ["replica", "--count", "2", "--port", str(http), "--model", MODEL,
         "--events", f"tcp://*:{events}", "--replay", f"tcp://127.0.0.1:{replay}",
         "--time-scale", "0.001", "--num-blocks", "1024", "--max-model-len", str(MAX_MODEL_LEN),
         "--max-body-bytes", str(MAX_BODY)],
        logs / "replica.log",
    )  # fmt: skip
    args = ["router", "--port", str(port), "--model", MODEL, "--max-body-bytes", str(MAX_BODY),
            "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
            # a busy 2-core CI machine must not take replicas out of rotation mid-fuzz
            "--health-timeout-s", "5", "--unhealthy-after", "20"]  # fmt: skip
    for i in range(2):
        endpoints = f"tcp://127.0.0.1:{events + i},replay=tcp://127.0.0.1:{replay + i}"
        args += ["--replica", f"replica-{i}={endpoints},url=http://127.0.0.1:{http + i}"]
    router = Process(args, logs / "router.log")
    procs = [replicas, router]
    engine_client = httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=BOUND_S)
    router_client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=BOUND_S)
    try:
        _wait_healthy(engine_client, replicas)
        _wait_healthy(router_client, router)
        yield Stack(router_client, engine_client, procs)
    finally:
        router_client.close()
        engine_client.close()
        for proc in procs:
            proc.signal(signal.SIGINT)
        for proc in procs:
            deadline = time.monotonic() + 15
            while proc.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.close()


# ---------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Case:
    """One request: ``invalid`` ones must get a 4xx (``status``: exactly that one)."""

    label: str
    body: bytes | tuple[bytes, ...]  # a tuple is sent chunked, without a Content-Length
    content_type: str | None = "application/json"
    invalid: bool = True
    status: int | None = None

    def __repr__(self) -> str:  # hypothesis prints failing cases: keep them readable
        body = self.body if isinstance(self.body, bytes) else b"<chunked>"
        return f"Case({self.label!r}, {body[:300]!r}, {self.content_type!r})"


def send(client: httpx.Client, method: str, path: str, case: Case) -> httpx.Response:
    headers = {"content-type": case.content_type} if case.content_type else {}
    started = time.monotonic()
    content = case.body if isinstance(case.body, bytes) else iter(case.body)
    response = client.request(method, path, content=content, headers=headers)
    elapsed = time.monotonic() - started
    LABELS.append(case.label)
    assert elapsed < BOUND_S, (case, elapsed)
    status = response.status_code
    assert status < 500, (case, status, response.text[:500])
    if case.invalid:
        assert 400 <= status < 500, (case, status, response.text[:500])
    if case.status is not None:
        assert status == case.status, (case, status, response.text[:500])
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS, (case, response.text[:500])
        assert isinstance(error["message"], str) and error["message"]
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), (case, response.text[-300:])
    return response


def _encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=False).encode()


_JSON_TYPES: dict[type, str] = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}
_JUNK = st.one_of(
    st.booleans(),
    st.sampled_from([0, -1, 2**63, -(2**63), 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _types(document: dict[str, Any], schema: dict[str, Any]) -> set[str]:
    schema = openapi.resolve(document, schema)
    if "oneOf" in schema and "type" not in schema:
        return set().union(*(_types(document, s) for s in schema["oneOf"]))
    kind = schema.get("type", "object")
    found = set(kind) if isinstance(kind, list) else {kind}
    return found | ({"number"} if "number" in found else set())


def _wrong_value(document: dict[str, Any], schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    allowed = _types(document, schema)
    return _JUNK.filter(lambda v: _JSON_TYPES[type(v)] not in allowed)


PROMPT_TEXT = st.text(st.characters(codec="utf-8"), max_size=200)
OVERRIDES: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "n": st.just(1),
    "tools": st.just([]),
    "chat_template_kwargs": st.just({}),
    "request_id": st.uuids().map(str),
    "content": PROMPT_TEXT,
    "text": PROMPT_TEXT,
}


@st.composite
def valid(draw: st.DrawFn, document: dict[str, Any], path: str) -> Case:
    """A body that conforms to the published schema (some may still be refused: a 4xx is fine,
    e.g. stream_options without stream; a 5xx or a stall is not)."""
    schema = openapi.request_schema(document, "POST", path)
    body = draw(openapi.from_schema(document, schema, OVERRIDES))
    return Case("valid", _encode(body), invalid=False)


@st.composite
def invalid(draw: st.DrawFn, document: dict[str, Any], path: str) -> Case:
    """A schema-conforming body broken by one mutation."""
    schema = openapi.request_schema(document, "POST", path)
    body: dict[str, Any] = draw(openapi.from_schema(document, schema, OVERRIDES))
    raw = _encode(body)
    properties = schema.get("properties", {})
    mutations = ["wrong_type", "top_level", "bad_json", "non_utf8", "content_type", "giant"]
    if schema.get("required"):
        mutations.append("missing")
    generation = "max_tokens" in properties
    if generation:
        mutations += ["unknown_model", "max_tokens", "stream_options", "enormous_prompt"]
    mutation = draw(st.sampled_from(mutations))
    if mutation == "missing":
        del body[draw(st.sampled_from(schema["required"]))]
        return Case(mutation, _encode(body))
    if mutation == "wrong_type":
        name = draw(st.sampled_from(sorted(properties)))
        body[name] = draw(_wrong_value(document, properties[name]))
        return Case(f"wrong_type:{name}", _encode(body))
    if mutation == "top_level":
        other = draw(st.sampled_from([[], [body], "x", 1, None, True]))
        return Case(mutation, _encode(other), status=400)
    if mutation == "bad_json":
        return Case(mutation, raw[: draw(st.integers(0, len(raw) - 1))], status=400)
    if mutation == "non_utf8":
        at = draw(st.integers(1, len(raw) - 1))
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xfe\xff"]))
        return Case(mutation, raw[:at] + junk + raw[at:], status=400)
    if mutation == "content_type":
        kind = draw(
            st.sampled_from(
                ["text/plain", "application/x-www-form-urlencoded", "text/json",
                 "multipart/form-data; boundary=x", "application/xml", "image/png"]
            )
        )  # fmt: skip
        return Case(mutation, raw, content_type=kind)
    if mutation == "giant":
        size = draw(st.sampled_from([MAX_BODY + 1, 2 * MAX_BODY, 16 * MAX_BODY]))
        padded = raw[:-1] + b', "padding": "' + b"x" * size + b'"}'
        if draw(st.booleans()):  # chunked, no Content-Length: the limit must hold while reading
            chunks = tuple(padded[i : i + 65536] for i in range(0, len(padded), 65536))
            return Case("giant_chunked", chunks, status=413)
        return Case(mutation, padded, status=413)
    return draw(generation_mutation(body, mutation, properties))


@st.composite
def generation_mutation(
    draw: st.DrawFn, body: dict[str, Any], mutation: str, properties: dict[str, Any]
) -> Case:
    """The mutations only generation requests (chat, completions) have fields for."""
    if mutation == "unknown_model":
        body["model"] = draw(st.text(min_size=1, max_size=20).filter(lambda m: m != MODEL))
        return Case(mutation, _encode(body), status=404)
    if mutation == "max_tokens":
        body.pop("max_completion_tokens", None)  # it would win over max_tokens
        body["max_tokens"] = draw(st.sampled_from([0, -1, -(2**63), 10**6, 2**31, 2**64, 10**30]))
        return Case(mutation, _encode(body))
    if mutation == "stream_options":
        body["stream"] = draw(st.sampled_from([True, True, False]))
        options = [5, "yes", [], {"include_usage": "yes"}, {"include_usage": 1},
                   {"continuous_usage_stats": []}]  # fmt: skip
        body["stream_options"] = (
            {"include_usage": True} if not body["stream"] else draw(st.sampled_from(options))
        )
        return Case(mutation, _encode(body), status=400)
    # enormous prompt: over the router's and the engine's limits, under the body limit
    tokens = draw(st.integers(MAX_MODEL_LEN + 1, 3 * MAX_MODEL_LEN))
    if "messages" in properties:
        body["messages"] = [{"role": "user", "content": "hello " * tokens}]
    else:
        body["prompt"] = draw(st.sampled_from(["hello " * tokens, [42] * tokens]))
    return Case(mutation, _encode(body), status=400)


def mixed(document: dict[str, Any], path: str) -> st.SearchStrategy[Case]:
    return st.one_of(valid(document, path), invalid(document, path), invalid(document, path))


# ---------------------------------------------------------------------------- router


@given(case=mixed(ROUTER_DOC, "/v1/chat/completions"))
@settings(FUZZ, max_examples=200)
def test_router_chat_completions(stack: Stack, case: Case) -> None:
    send(stack.router, "POST", "/v1/chat/completions", case)


@given(case=mixed(ROUTER_DOC, "/v1/completions"))
@settings(FUZZ, max_examples=200)
def test_router_completions(stack: Stack, case: Case) -> None:
    send(stack.router, "POST", "/v1/completions", case)


@given(case=mixed(ROUTER_DOC, "/index"))
@settings(FUZZ, max_examples=80)
def test_router_index(stack: Stack, case: Case) -> None:
    send(stack.router, "POST", "/index", case)


# ---------------------------------------------------------------------------- engine


@given(case=mixed(ENGINE_DOC, "/v1/chat/completions"))
@settings(FUZZ, max_examples=120)
def test_engine_chat_completions(stack: Stack, case: Case) -> None:
    send(stack.engine, "POST", "/v1/chat/completions", case)


@given(case=mixed(ENGINE_DOC, "/v1/completions"))
@settings(FUZZ, max_examples=120)
def test_engine_completions(stack: Stack, case: Case) -> None:
    send(stack.engine, "POST", "/v1/completions", case)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/tokenize",
        "/detokenize",
        "/kvrouter/probe",
    ],
)
@given(data=st.data())
@settings(FUZZ, max_examples=40)
def test_engine_tokenization_routes(stack: Stack, path: str, data: st.DataObject) -> None:
    send(stack.engine, "POST", path, data.draw(mixed(ENGINE_DOC, path)))


# ---------------------------------------------------------------------------- both


@pytest.mark.parametrize("target", ["router", "engine"])
def test_unknown_routes_and_methods_get_openai_errors(stack: Stack, target: str) -> None:
    client = getattr(stack, target)
    for method, path, status in [
        ("GET", "/v1/chat/completions", 405),
        ("PUT", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("GET", "/v1/nope", 404),
        ("POST", "/../../etc/passwd", 404),
        ("GET", "/" + "a" * 4000, 404),
    ]:
        send(client, method, path, Case(f"{method} {path[:20]}", b"", None, status=status))


@pytest.mark.parametrize("target", ["router", "engine"])
def test_documented_routes_are_the_served_routes(stack: Stack, target: str) -> None:
    """Every documented operation exists (no 404/405) and nothing undocumented answers."""
    client: httpx.Client = getattr(stack, target)
    document = ROUTER_DOC if target == "router" else ENGINE_DOC
    documented = openapi.operations(document)
    for method, path in sorted(documented):
        if path == "/reset_prefix_cache":
            continue  # it works (tests/publishers), but would empty the cache under the fuzz
        body = b"{}" if method == "POST" else None
        response = client.request(method, path, content=body)
        assert response.status_code not in (404, 405), (method, path)
    for method in ("GET", "POST"):
        for path in {path for _, path in documented}:
            if (method, path) not in documented:
                answer = client.request(method, path)
                assert answer.status_code == 405, (method, path, answer.status_code)


def test_no_process_logged_a_traceback(stack: Stack) -> None:
    """Run last: nothing above made either process hit an unhandled exception."""
    if LABELS:  # the whole module ran: every kind of request was sent
        kinds = {label.partition(":")[0] for label in LABELS}
        assert kinds >= {
            "valid", "missing", "wrong_type", "top_level", "bad_json", "non_utf8",
            "content_type", "giant", "giant_chunked", "unknown_model", "max_tokens",
            "stream_options", "enormous_prompt",
        }  # fmt: skip
    for proc in stack.procs:
        assert proc.alive, proc.log()
        log = proc.log()
        assert "Traceback" not in log, log[-5000:]
        assert "request failed" not in log, log[-5000:]
