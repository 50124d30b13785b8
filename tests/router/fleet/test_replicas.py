"""The replica set (registry view, health state machine), engine metrics, bearer keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.requests import Request

from router.config import RouterSettings
from router.fleet.health import parse_engine_metrics
from router.fleet.replicas import EngineLoad, ReplicaSet
from router.http.auth import KeyCheck, load_keys
from tracker.core.index import ReplicaRecord
from tracker.core.replicas import ReplicaSpec
from tracker.framework.errors import ConfigError

STATIC = ReplicaSpec.parse("s0=tcp://h:5557,url=http://h:8000")


def record(rid: str, **kw: object) -> ReplicaRecord:
    options: dict[str, object] = {"model": "m", "block_size": 16, "url": f"http://{rid}:8000"}
    options.update(kw)
    return ReplicaRecord(id=rid, **options)  # type: ignore[arg-type]


def test_registry_view_with_grace_for_missing_entries() -> None:
    replicas = ReplicaSet([STATIC], model="m", block_size=32, unhealthy_after=3, engine_stale_s=5.0)
    assert replicas.get("s0").block_size == 32  # type: ignore[union-attr]
    records = [
        record("s0", block_size=16, instance="a"),
        record("r1", ttl_s=5.0),
        record("nourl", url=None),
    ]
    added, removed = replicas.reconcile(records, now=0.0)
    assert (added, removed) == (["r1"], [])
    assert replicas.get("s0").block_size == 16  # type: ignore[union-attr]
    assert [r.id for r in replicas.candidates("m")] == ["r1", "s0"]
    # an empty registry (Redis restarted) does not empty the router at once...
    assert replicas.reconcile([], now=1.0) == ([], [])
    assert replicas.reconcile([], now=5.9) == ([], [])
    # ...but an entry missing for its whole ttl goes; configured replicas never do
    assert replicas.reconcile([], now=6.0) == ([], ["r1"])
    assert [r.id for r in replicas.all()] == ["s0"]
    assert replicas.models() == ["m"]


def test_health_state_machine() -> None:
    replicas = ReplicaSet([STATIC], model="m", block_size=16, unhealthy_after=3, engine_stale_s=5.0)
    assert not replicas.failed("s0", "timeout")
    assert not replicas.failed("s0", "timeout")
    assert replicas.failed("s0", "timeout")
    assert replicas.candidates("m") == []
    assert replicas.serves("m")
    assert replicas.succeeded("s0")
    assert replicas.candidates("m")[0].failures == 0
    assert replicas.failed("s0", "refused", now=True)  # nothing listens: out at once
    assert not replicas.failed("ghost", "x")


def test_engine_metrics_expire() -> None:
    replicas = ReplicaSet([STATIC], model="m", block_size=16, unhealthy_after=3, engine_stale_s=5.0)
    replica = replicas.get("s0")
    assert replica is not None
    replica.engine = EngineLoad(1, 2, 0.5, at=100.0)
    assert replicas.engine_load(replica, now=104.0) == replica.engine
    assert replicas.engine_load(replica, now=106.0) is None


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
"""


def test_engine_metrics_parsing() -> None:
    assert parse_engine_metrics(VLLM_METRICS, 1.0) == EngineLoad(4, 2, 0.75, 1.0)
    old = "vllm:gpu_cache_usage_perc 0.5\n"
    assert parse_engine_metrics(old, 2.0) == EngineLoad(None, None, 0.5, 2.0)
    # the KV cache's size, from vLLM's info gauge (summed over data-parallel engines)
    info = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="661"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="661"} 1.0\n'
    )
    assert parse_engine_metrics(VLLM_METRICS + info, 3.0).cache_blocks == 1322
    unknown = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    assert parse_engine_metrics(unknown, 3.0).cache_blocks is None


def _request(authorization: str | None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "headers": headers, "method": "GET", "path": "/"})


def test_bearer_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nk2\n\n  k3  \n")
    keys = load_keys("k1", str(path), "api-key")
    assert keys == {b"k1", b"k2", b"k3"}
    check = KeyCheck(keys)
    assert check.allows(_request("Bearer k3"))
    assert check.allows(_request("bearer k1"))
    assert not check.allows(_request("Bearer k4"))
    assert not check.allows(_request("Basic k1"))
    assert not check.allows(_request(None))
    assert KeyCheck(frozenset()).allows(_request(None))
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_keys(None, str(empty), "api-key")
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_keys(None, str(tmp_path / "absent"), "api-key")
    assert "k1" not in str(info.value)


def test_settings_mask_secrets_and_check_replicas() -> None:
    settings = RouterSettings.from_env(
        {
            "KVROUTER_ROUTER_API_KEY": "sk-secret",
            "KVROUTER_ROUTER_REPLICA": "a=tcp://h:1,url=http://h:2 b=tcp://h:3,url=http://h:4",
            "KVROUTER_ROUTER_TOKENIZER": "m1=/t1 /t0",
        }
    )
    assert [s.id for s in settings.replica_specs] == ["a", "b"]
    assert settings.describe()["api_key"] == "***"
    with pytest.raises(ConfigError, match="url="):
        RouterSettings(replica=("a=tcp://h:1",))
    with pytest.raises(ConfigError, match="twice"):
        RouterSettings(replica=("a=tcp://h:1,url=http://h:2", "a=tcp://h:3,url=http://h:4"))
    with pytest.raises(ConfigError, match="more than one"):
        RouterSettings(tokenizer=("/a", "/b"))
    with pytest.raises(ConfigError, match="load-renew-s"):
        RouterSettings(lease_ttl_s=1.0, load_renew_s=1.0)
