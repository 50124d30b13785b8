"""Redis with AUTH and mutual TLS (``rediss://``): the index, the load board and the commands.

A throwaway CA, server and client certificate are made with ``openssl``; a real redis-server
listens on TLS only (``--port 0``), requires a password and client certificates.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.factories import SIM, SMALL, batch, stored
from tests.procs import KVROUTER, free_port, wait_for_port
from tracker.core.blocks import block_keys
from tracker.core.index import ReplicaRecord
from tracker.core.redis_index import RedisIndex
from tracker.framework.errors import IndexUnavailableError

PASSWORD = "s3cret-redis-pw"
TOKENS = list(range(1, 13))

pytestmark = pytest.mark.timeout(60)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> None:
    """ca.crt; server.crt/key for 127.0.0.1; client.crt/key; all EC P-256, valid one day."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=kvrouter-test-ca", cwd=directory)  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=kvrouter-test-{name}", cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
                 "-extfile", "san.ext", cwd=directory)  # fmt: skip


@dataclass
class TLSRedis:
    port: int
    certs: Path

    def url(self, password: str | None = PASSWORD, *, client_cert: bool = True) -> str:
        query = {"ssl_ca_certs": str(self.certs / "ca.crt"), "ssl_cert_reqs": "required"}
        if client_cert:
            query["ssl_certfile"] = str(self.certs / "client.crt")
            query["ssl_keyfile"] = str(self.certs / "client.key")
        auth = f":{password}@" if password is not None else ""
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{urlencode(query)}"


@pytest.fixture(scope="module")
def tls_redis() -> Iterator[TLSRedis]:
    binary = shutil.which("redis-server")
    if binary is None or shutil.which("openssl") is None:
        pytest.fail("redis-server and openssl are needed (scripts/test installs them)")
    work = Path(tempfile.mkdtemp(prefix="kvr-tls-"))
    make_certificates(work)
    port = free_port()
    options = {
        "port": "0",  # TLS only
        "tls-port": str(port),
        "bind": "127.0.0.1",
        "tls-cert-file": str(work / "server.crt"),
        "tls-key-file": str(work / "server.key"),
        "tls-ca-cert-file": str(work / "ca.crt"),
        "tls-auth-clients": "yes",
        "requirepass": PASSWORD,
        "save": "",
        "appendonly": "no",
        "dir": str(work),
    }
    proc = subprocess.Popen(
        [binary, *(arg for name, value in options.items() for arg in (f"--{name}", value))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield TLSRedis(port, work)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


async def test_index_load_and_registry_over_tls_with_auth(tls_redis: TLSRedis) -> None:
    from router.shared.redis_load import RedisLoadBoard

    index = RedisIndex.from_url(tls_redis.url())
    try:
        await index.client.flushall()
        await index.apply("tls-r", SMALL, batch(stored(TOKENS, [11, 12, 13])), seq=0)
        matches = await index.lookup(SMALL, block_keys(TOKENS, SMALL))
        assert matches["tls-r"].blocks == 3
        assert await index.last_seq("tls-r", SMALL) == 0
        await index.register(ReplicaRecord(id="tls-r", model="m", block_size=4, url="http://x"))
        assert [r.id for r in await index.replicas()] == ["tls-r"]
        # the routers' shared load rides on the index's client: TLS and AUTH included
        one = RedisLoadBoard(index.client, "router-1", lease_ttl_s=5.0, renew_interval_s=1.0)
        two = RedisLoadBoard(index.client, "router-2", lease_ttl_s=5.0, renew_interval_s=1.0)
        await one.start()
        try:
            lease = one.acquire(SMALL, "tls-r", 100)
            deadline = time.monotonic() + 5
            while "tls-r" not in (seen := await two.snapshot(SMALL)):
                assert time.monotonic() < deadline, "router-2 never saw router-1's load"
                await asyncio.sleep(0.02)
            assert seen["tls-r"].inflight == 1
            lease.release()
        finally:
            await one.stop()
    finally:
        await index.close()


@pytest.mark.parametrize(
    ("case", "url_of"),
    [
        ("wrong password", lambda r: r.url("not-the-password")),
        ("no password", lambda r: r.url(None)),
        ("no client certificate", lambda r: r.url(client_cert=False)),
        ("plain TCP to the TLS port", lambda r: f"redis://:{PASSWORD}@127.0.0.1:{r.port}/0"),
    ],
)
async def test_refused_connections_fail_cleanly(
    tls_redis: TLSRedis, case: str, url_of: Any
) -> None:
    url = url_of(tls_redis)
    index = RedisIndex.from_url(url, timeout_s=1.0)
    started = time.monotonic()
    with warnings.catch_warnings():
        # redis-py drops (unclosed) the socket of a TLS handshake the server refused
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            with pytest.raises(IndexUnavailableError) as info:
                await index.lookup(SMALL, block_keys(TOKENS, SMALL))
        finally:
            await index.close()
        gc.collect()
    assert time.monotonic() - started < 5, case
    assert PASSWORD not in str(info.value) and "not-the-password" not in str(info.value)


def _kvrouter(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVROUTER), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


async def test_lookup_command_over_tls(tls_redis: TLSRedis) -> None:
    index = RedisIndex.from_url(tls_redis.url())
    try:
        await index.client.flushall()
        await index.apply("tls-r", SMALL, batch(stored(TOKENS, [11, 12, 13])), seq=0)
    finally:
        await index.close()
    tokens = ",".join(map(str, TOKENS))
    common = ["--model", "m", "--block-size", "4", "--tokens", tokens]
    ok = _kvrouter("lookup", "--redis", tls_redis.url(), *common)
    assert ok.returncode == 0, ok.stderr
    assert '"matched_blocks": 3' in ok.stdout
    bad = _kvrouter("lookup", "--redis", tls_redis.url("not-the-password"), *common)
    assert bad.returncode == 1
    assert "kvrouter lookup:" in bad.stderr and "Traceback" not in bad.stderr
    assert "not-the-password" not in bad.stdout + bad.stderr
    malformed = _kvrouter(
        "lookup", "--redis", f"rediss://:{PASSWORD}@127.0.0.1:notaport/0", *common
    )
    assert malformed.returncode == 2 and "Traceback" not in malformed.stderr
    assert PASSWORD not in malformed.stdout + malformed.stderr


@pytest.mark.timeout(90)
async def test_replica_tracker_and_router_processes_over_tls(
    tls_redis: TLSRedis, tmp_path: Path
) -> None:
    """A fleet registers, a tracker indexes and a router routes, all through rediss:// + AUTH;
    no secret (Redis password, API or operator key) shows up in any log, even at debug level."""
    import httpx

    from tests.router.harness import Process, chat, engines, wait_healthy, wait_until

    api_key, admin_key, upstream_key = "sk-client-7f3a", "sk-admin-91bc", "sk-upstream-55d0"
    keys = tmp_path / "api-keys"
    keys.write_text(f"# clients\n{api_key}\n")
    index = RedisIndex.from_url(tls_redis.url())
    await index.client.flushall()
    debug = ["--log-level", "debug", "--log-format", "json"]
    port = free_port()
    procs: list[Process] = []
    try:
        async with engines(1, redis=tls_redis.url(), heartbeat_s=0.5, ttl_s=2.0):
            procs.append(
                Process(
                    ["tracker", "--redis", tls_redis.url(), "--http-port", "0", *debug],
                    tmp_path / "tracker.log",
                )
            )
            router = Process(
                ["router", "--redis", tls_redis.url(), "--port", str(port), *debug,
                 "--api-key-file", str(keys), "--admin-key", admin_key,
                 "--upstream-api-key", upstream_key],
                tmp_path / "router.log",
            )  # fmt: skip
            procs.append(router)
            url = f"http://127.0.0.1:{port}"
            await wait_healthy(url, router)
            auth = {"authorization": f"Bearer {api_key}"}
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                first = await client.post(
                    "/v1/chat/completions", json=chat("s" * 400, "a"), headers=auth
                )
                assert first.status_code == 200, first.text
                for wrong in ("Bearer nope", f"Bearer {admin_key}", f"Basic {api_key}"):
                    denied = await client.get("/v1/models", headers={"authorization": wrong})
                    assert denied.status_code == 401

                async def indexed() -> bool:  # the tracker wrote the engine's blocks over TLS
                    return await index.block_count("replica-0", SIM) > 0

                await wait_until(indexed, 20)
                query = {"model": "sim", "messages": chat("s" * 400, "a")["messages"]}
                where = await client.post(
                    "/index", json=query, headers={"authorization": f"Bearer {admin_key}"}
                )
                assert where.status_code == 200, where.text
                assert where.json()["replicas"]["replica-0"]["matched_blocks"] > 0
        for proc in procs:
            proc.signal(2)
            assert await proc.wait() == 0, proc.log()
        for proc in procs:
            log = proc.log()
            assert "Traceback" not in log
            for secret in (PASSWORD, api_key, admin_key, upstream_key):
                assert secret not in log, (proc.args[0], secret)
    finally:
        for proc in procs:
            proc.close()
        await index.close()


@pytest.mark.timeout(60)
async def test_wrong_redis_password_is_reported_without_leaking_it(
    tls_redis: TLSRedis, tmp_path: Path
) -> None:
    from tests.router.harness import Process, wait_until

    wrong = tls_redis.url("wrong-pw-4411")
    port = free_port()
    procs = [
        Process(["tracker", "--redis", wrong, "--http-port", "0"], tmp_path / "tracker.log"),
        Process(["router", "--redis", wrong, "--port", str(port)], tmp_path / "router.log"),
    ]
    try:
        for proc, says in zip(procs, ("registry unavailable", "registry unreachable"), strict=True):
            await wait_until(lambda proc=proc, says=says: says in proc.log(), 20)
            assert proc.alive  # degraded, not dead: it keeps retrying
            proc.signal(2)
            await proc.wait()
            log = proc.log()
            assert "wrong-pw-4411" not in log and "Traceback" not in log, log
            assert "invalid username-password pair" in log, log
    finally:
        for proc in procs:
            proc.close()
