"""The router app over real uvicorn, in front of simulated engines with an embedded tracker."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from router.config import RouterSettings
from router.decide.scoring import prefill_work
from router.decide.tokenize import TokenizerBook
from router.http.app import create_app
from router.http.proxy import PREDICTED_HEADER, REPLICA_HEADER
from tests.router.harness import (
    SYSTEM,
    base_url,
    chat,
    engines,
    metric,
    router,
    wait_until,
)
from tracker.core.memory_index import MemoryIndex
from tracker.core.tokens import Tokenizer
from tracker.framework.errors import ConfigError

pytestmark = pytest.mark.timeout(30)


async def test_shared_prefix_lands_on_one_replica_with_exact_predictions() -> None:
    async with engines(2) as fleet, router(replica=fleet.specs) as service:
        async with httpx.AsyncClient(base_url=base_url(service), timeout=10) as client:
            first = await client.post(
                "/v1/chat/completions", json=chat(SYSTEM, "one"), headers={"x-request-id": "r-1"}
            )
            assert first.status_code == 200, first.text
            assert first.headers["x-request-id"] == "r-1"
            assert first.headers[PREDICTED_HEADER] == "0"
            assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            home = first.headers[REPLICA_HEADER]
            for i in range(3):
                answer = await client.post("/v1/chat/completions", json=chat(SYSTEM, f"q {i}"))
                cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert answer.headers[REPLICA_HEADER] == home
                assert cached > 1000
                assert int(answer.headers[PREDICTED_HEADER]) == cached
            # completions: the prompt text is tokenized with special tokens, as vLLM does
            prompt = {"model": "sim", "prompt": SYSTEM + "continue", "max_tokens": 3}
            await client.post("/v1/completions", json=prompt)
            again = await client.post("/v1/completions", json=prompt)
            assert again.status_code == 200
            engine_cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert int(again.headers[PREDICTED_HEADER]) == engine_cached > 1000
            page = (await client.get("/metrics")).text
        assert metric(page, "kvrouter_router_cache_predictions_total", outcome="agree") == 6
        assert metric(page, "kvrouter_router_requests_total", endpoint="chat", status="200") == 4
        assert metric(page, "kvrouter_router_predictions_total", status="ok") >= 5
        for stage in ("tokenize", "hash", "lookup", "score", "total"):
            assert metric(page, "kvrouter_router_decision_seconds_count", stage=stage) == 6
        predicted = metric(page, "kvrouter_router_predicted_cached_tokens_total")
        assert predicted == metric(page, "kvrouter_router_engine_cached_tokens_total") > 0


async def test_models_are_the_union_and_requests_only_reach_their_model() -> None:
    async with (
        engines(1, model="alpha") as alpha,
        engines(1, model="beta", id_prefix="beta-") as beta,
        router(
            replica=(*alpha.specs, *(s + ",model=beta" for s in beta.specs)), model="alpha"
        ) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["alpha", "beta"]
        for _ in range(3):
            answer = await client.post(
                "/v1/chat/completions", json={**chat("s", "u"), "model": "beta"}
            )
            assert answer.status_code == 200
            assert answer.headers[REPLICA_HEADER] == "beta-0"
        unknown = await client.post("/v1/chat/completions", json={**chat("s", "u"), "model": "x"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        # two models: a request must name one
        anonymous = await client.post("/v1/completions", json={"prompt": "hi"})
        assert anonymous.status_code == 400
        assert anonymous.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", b'{"model": "sim"}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "sim", "messages": "hi"}', 400, "messages"),
        (
            "/v1/chat/completions",
            b'{"model": "sim", "messages": [{"content": "x"}]}',
            400,
            "messages",
        ),
        ("/v1/chat/completions", b'{"model": 3, "messages": [{"role": "user"}]}', 400, "model"),
        ("/v1/completions", b'{"model": "sim"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "sim", "prompt": [true]}', 400, "prompt"),
        ("/v1/completions", b'{"model": "sim", "prompt": "x", "stream": "yes"}', 400, "stream"),
        ("/v1/completions", b'{"model": "sim", "prompt": "' + b"x" * 300 + b'"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "sim", "prompt": "' + b"x" * 5000 + b'"}', 413, None),
        ("/v1/nothing", b"{}", 404, None),
    ],
)
async def test_malformed_requests_get_openai_errors(
    path: str, body: bytes, status: int, param: str | None
) -> None:
    settings = RouterSettings(
        replica=("r=tcp://127.0.0.1:1,url=http://127.0.0.1:9",),
        model="sim",
        max_body_bytes=4096,
        max_prompt_tokens=256,
    )
    app = create_app(settings, index=MemoryIndex(), registry=CollectorRegistry())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        response = await client.post(path, content=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


async def test_api_and_operator_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# operators\nadmin-1\n\nadmin-2\n")
    async with (
        engines(1) as fleet,
        router(replica=fleet.specs, api_key="sk-client", admin_key_file=str(keys)) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        missing = await client.post("/v1/chat/completions", json=chat("s", "u"))
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        wrong = await client.get("/v1/models", headers={"authorization": "Bearer sk-other"})
        assert wrong.status_code == 401
        ok = await client.post(
            "/v1/chat/completions",
            json=chat("s", "u"),
            headers={"authorization": "Bearer sk-client"},
        )
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200
        client_key = {"authorization": "Bearer sk-client"}
        assert (await client.get("/replicas", headers=client_key)).status_code == 401
        for key in ("admin-1", "admin-2"):
            page = await client.get("/metrics", headers={"authorization": f"Bearer {key}"})
            assert page.status_code == 200
            assert "sk-client" not in page.text
    with pytest.raises(ConfigError, match="cannot read"):
        router_missing = RouterSettings(api_key_file=str(tmp_path / "absent"))
        create_app(router_missing, index=MemoryIndex(), registry=CollectorRegistry())


async def test_the_prefill_speed_starts_from_the_configured_seed() -> None:
    async with (
        engines(2) as fleet,
        router(replica=fleet.specs, prefill_floor_ms=40.0, prefill_ms_per_token=0.5) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        answer = await client.post("/index", json={"model": "sim", "token_ids": [7] * 100})
        scores = answer.json()["decision"]["scores"]
        # nothing observed yet: the estimate is the seed, whatever the replica
        own = prefill_work(100, 0, RouterSettings().attention_tokens)
        assert [s["prefill_ms"] for s in scores] == [pytest.approx(40.0 + 0.5 * own)] * 2
    for bad in ({"prefill_ms_per_token": 0.0}, {"prefill_floor_ms": -1.0}):
        with pytest.raises(ConfigError, match="prefill"):
            RouterSettings(**bad)  # type: ignore[arg-type]


async def test_index_query_is_a_dry_run_with_score_breakdown() -> None:
    async with (
        engines(2) as fleet,
        router(replica=fleet.specs) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        home = (await client.post("/v1/chat/completions", json=chat(SYSTEM, "a"))).headers[
            REPLICA_HEADER
        ]
        query = {"model": "sim", "messages": chat(SYSTEM, "b")["messages"]}
        answer = (await client.post("/index", json=query)).json()
        assert answer["decision"]["replica"] == home
        held = answer["replicas"][home]
        assert held["matched_tokens"] == held["matched_blocks"] * 16 > 1000
        assert held["tier"] == "gpu"
        scores = answer["decision"]["scores"]
        assert scores[0]["replica"] == home
        assert {"queue_ms", "prefill_ms", "expected_ttft_ms", "work_tokens"} <= set(scores[0])
        assert set(answer["stages_ms"]) == {"tokenize", "hash", "lookup", "score", "total"}
        # token ids work too, and the dry run left no load behind
        ids = (await client.post("/index", json={"model": "sim", "token_ids": [1, 2, 3]})).json()
        assert ids["prompt_tokens"] == 3
        assert ids["blocks"] == 0
        bad = await client.post("/index", json={"model": "sim", "prompt": "x", "token_ids": [1]})
        assert bad.status_code == 400
        replicas = (await client.get("/replicas")).json()["replicas"]
        assert [r["id"] for r in replicas] == ["replica-0", "replica-1"]
        assert all(r["inflight"] == 0 and r["healthy"] for r in replicas)
        replica = service.router.replicas.get("replica-0")
        assert replica is not None
        # a scrape after the request ended (on a busy host one may have caught it running)
        await wait_until(lambda: replica.engine is not None and replica.engine.running == 0)
        engine = (await client.get("/replicas")).json()["replicas"][0]["engine"]
        assert engine["running"] == 0 and 0 <= engine["kv_usage"] <= 1


async def test_a_wrong_chat_template_is_flagged_as_a_hash_mismatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    template = tmp_path / "other.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    async with (
        engines(1) as fleet,
        router(replica=fleet.specs, chat_template=(str(template),), mismatch_window=5) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        for i in range(7):
            answer = await client.post("/v1/chat/completions", json=chat(SYSTEM, f"q{i}"))
            assert answer.status_code == 200
        page = (await client.get("/metrics")).text
    assert metric(page, "kvrouter_router_hash_mismatch", model="sim") == 1
    assert metric(page, "kvrouter_router_engine_cached_tokens_total") > 5000
    assert any("never placed there" in r.getMessage() for r in caplog.records)


async def test_tokenizer_and_template_per_model_from_files(tmp_path: Path) -> None:
    tokenizer_json = tmp_path / "tokenizer.json"
    Tokenizer.builtin().hf.save(str(tokenizer_json))
    template = tmp_path / "chat_template.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
    )
    files = {"tokenizer": str(tokenizer_json), "chat_template": str(template)}
    book = TokenizerBook.load(
        RouterSettings(tokenizer=(f"sim={tokenizer_json}",), chat_template=(f"sim={template}",))
    )
    assert book.for_model("sim") is not book.for_model("other") is book.default
    async with (
        engines(1, **files) as fleet,
        router(
            replica=fleet.specs,
            tokenizer=(f"sim={tokenizer_json}",),
            chat_template=(f"sim={template}",),
        ) as service,
        httpx.AsyncClient(base_url=base_url(service), timeout=10) as client,
    ):
        await client.post("/v1/chat/completions", json=chat(SYSTEM, "a"))
        answer = await client.post("/v1/chat/completions", json=chat(SYSTEM, "b"))
        cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(answer.headers[PREDICTED_HEADER]) == cached > 1000
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        TokenizerBook.load(RouterSettings(tokenizer=(str(tmp_path / "missing.json"),)))
