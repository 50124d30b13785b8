"""Replica spec parsing: ``ID=EVENTS[,replay=...][,url=...][,model=...][,block_size=...]``."""

from __future__ import annotations

import pytest

from tracker.core.replicas import ReplicaSpec
from tracker.framework.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("r1=tcp://h:5557", ReplicaSpec("r1", "tcp://h:5557")),
        (
            "r1=tcp://h:5557,replay=tcp://h:5558,url=http://h:8000",
            ReplicaSpec("r1", "tcp://h:5557", "tcp://h:5558", "http://h:8000"),
        ),
        (
            "r1=tcp://h:5557,url=https://h,replay=tcp://h:5558",
            ReplicaSpec("r1", "tcp://h:5557", "tcp://h:5558", "https://h"),
        ),
        (
            "r1=tcp://h:5557,model=llama-3,block_size=32",
            ReplicaSpec("r1", "tcp://h:5557", model="llama-3", block_size=32),
        ),
        ("  r1=tcp://h:5557  ", ReplicaSpec("r1", "tcp://h:5557")),
        ("r1=tcp://h:5557,", ReplicaSpec("r1", "tcp://h:5557")),
        (
            "gpu-0.pod/a@b:1=tcp://10.0.0.7:5557",
            ReplicaSpec("gpu-0.pod/a@b:1", "tcp://10.0.0.7:5557"),
        ),
        ("r1=tcp://*:5557", ReplicaSpec("r1", "tcp://*:5557")),
        ("r1=tcp://[::1]:5557", ReplicaSpec("r1", "tcp://[::1]:5557")),
        ("r1=tcp://h:*", ReplicaSpec("r1", "tcp://h:*")),
        ("r1=ipc:///tmp/kv.sock", ReplicaSpec("r1", "ipc:///tmp/kv.sock")),
        ("r1=inproc://kv", ReplicaSpec("r1", "inproc://kv")),
    ],
)
def test_parse_accepts(text: str, expected: ReplicaSpec) -> None:
    assert ReplicaSpec.parse(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("r1", id="missing-equals"),
        pytest.param("", id="empty"),
        pytest.param("=tcp://h:5557", id="empty-id"),
        pytest.param("r1=", id="empty-endpoint"),
        pytest.param("r 1=tcp://h:5557", id="space-in-id"),
        pytest.param("-r1=tcp://h:5557", id="id-starts-with-dash"),
        pytest.param("r1=http://h:5557", id="http-endpoint"),
        pytest.param("r1=h:5557", id="endpoint-without-scheme"),
        pytest.param("r1=tcp://h", id="tcp-without-port"),
        pytest.param("r1=tcp://h:port", id="tcp-port-not-a-number"),
        pytest.param("r1=tcp://:5557", id="tcp-without-host"),
        pytest.param("r1=tcp://h:0", id="tcp-port-0"),
        pytest.param("r1=tcp://h:70000", id="tcp-port-too-big"),
        pytest.param("r1=ipc://", id="ipc-without-path"),
        pytest.param("r1=tcp://h:5557,foo=bar", id="unknown-option"),
        pytest.param("r1=tcp://h:5557,replay", id="option-without-value"),
        pytest.param("r1=tcp://h:5557,url=", id="option-empty-value"),
        pytest.param("r1=tcp://h:5557,Replay=tcp://h:5558", id="option-case"),
        pytest.param("r1=tcp://h:5557,url=http://a,url=http://b", id="repeated-url"),
        pytest.param("r1=tcp://h:5557,replay=tcp://h:1,replay=tcp://h:2", id="repeated-replay"),
        pytest.param("r1=tcp://h:5557,url=ftp://h", id="ftp-url"),
        pytest.param("r1=tcp://h:5557,url=h:8000", id="url-without-scheme"),
        pytest.param("r1=tcp://h:5557,replay=http://h:5558", id="bad-replay-endpoint"),
        pytest.param("r1=tcp://h:5557,replay=tcp://h", id="replay-without-port"),
        pytest.param("r1=tcp://h:5557,block_size=0", id="block-size-0"),
        pytest.param("r1=tcp://h:5557,block_size=-4", id="block-size-negative"),
        pytest.param("r1=tcp://h:5557,block_size=x", id="block-size-not-int"),
    ],
)
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        ReplicaSpec.parse(text)
    assert repr(text.strip()) in str(info.value) or text.strip() in str(info.value)
