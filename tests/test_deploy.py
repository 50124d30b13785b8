"""Static checks of the deployment files: Dockerfile, docker-compose.yml, deploy/haproxy.cfg.

No Docker engine is needed: every kvrouter command in the compose file is parsed by
kvrouter's own argument parser and settings classes (so a renamed flag fails here), the
addresses that tie the services together are compared with each other, haproxy checks its
own configuration, and `docker compose config` runs where a compose client is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import redirect_stderr
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from publishers.config import WILDCARD_HOSTS, AttachSettings, ReplicaSettings, tcp_parts
from publishers.fleet import FleetService
from publishers.vllm import vllm_env, vllm_flags
from router.config import RouterSettings
from tracker.framework.cli import Command, build_parser, load_commands
from tracker.framework.settings import Settings
from tracker.ingest.config import TrackerSettings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
HAPROXY_CFG_IN_IMAGE = "/usr/local/etc/haproxy/haproxy.cfg"
REDIS_PORT = 6379

COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
# services running the image built from this repository (the others are redis and haproxy)
KVROUTER_SERVICES = sorted(name for name, svc in SERVICES.items() if "build" in svc)


@dataclass(frozen=True)
class Parsed:
    """A service's command, as kvrouter itself would read it."""

    command: Command
    settings: Any


def environment(service: dict[str, Any]) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.partition("=")[::2] for item in raw)
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def parse_command(argv: list[str], env: dict[str, str]) -> Parsed:
    """``kvrouter ARGV`` with environment ``env``, as ``tracker.framework.cli.main`` reads it."""
    commands = load_commands()
    parser = build_parser(commands)
    errors = StringIO()
    try:
        with redirect_stderr(errors):
            args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"kvrouter {shlex.join(argv)}: {errors.getvalue().strip().splitlines()[-1]}")
    command = commands[args.command]
    del args.command
    return Parsed(command, command.settings.from_args(args, env))


def parsed(name: str) -> Parsed:
    service = SERVICES[name]
    return parse_command([str(a) for a in service["command"]], environment(service))


def of_kind(kind: type[Settings]) -> dict[str, Any]:
    """Settings of every kvrouter service whose command builds ``kind``."""
    out = {}
    for name in KVROUTER_SERVICES:
        settings = parsed(name).settings
        if isinstance(settings, kind):
            out[name] = settings
    return out


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


DOCKER = dockerfile_instructions(DOCKERFILE.read_text())


def last(instruction: str) -> str:
    values = [rest for keyword, rest in DOCKER if keyword == instruction]
    assert values, f"Dockerfile has no {instruction}"
    return values[-1]


def final_stage() -> list[tuple[str, str]]:
    starts = [i for i, (keyword, _) in enumerate(DOCKER) if keyword == "FROM"]
    return DOCKER[starts[-1] :]


def haproxy_backend_servers(backup: bool = False) -> dict[str, tuple[str, int]]:
    """``server NAME HOST:PORT`` lines of the ``routers`` backend: primary or ``backup``."""
    servers: dict[str, tuple[str, int]] = {}
    section = None
    for line in HAPROXY_CFG.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if not line[0].isspace():
            section = words
            continue
        if (
            section == ["backend", "routers"]
            and words[0] == "server"
            and ("backup" in words) == backup
        ):
            host, _, port = words[2].rpartition(":")
            servers[words[1]] = (host, int(port))
    return servers


def haproxy_frontend_port() -> int:
    match = re.search(r"^frontend\s.*?^\s+bind\s+\S*:(\d+)", HAPROXY_CFG.read_text(), re.M | re.S)
    assert match, "deploy/haproxy.cfg has no frontend bind"
    return int(match[1])


# --------------------------------------------------------------------- compose commands


@pytest.mark.parametrize("name", KVROUTER_SERVICES)
def test_every_kvrouter_command_parses_with_the_real_parser(name: str) -> None:
    result = parsed(name)
    assert result.command.name in {"tracker", "router", "replica"}
    unknown = {
        var
        for var in environment(SERVICES[name])
        if var.startswith("KVROUTER_")
        and var not in {result.command.settings.env_name(f) for f in vars(result.settings)}
    }
    assert not unknown, f"{name}: environment variables no setting reads: {unknown}"


def test_the_stack_has_the_expected_shape() -> None:
    counts: dict[str, int] = {}
    for name in KVROUTER_SERVICES:
        kind = parsed(name).command.name
        counts[kind] = counts.get(kind, 0) + 1
    engines = sum(s.count for s in of_kind(ReplicaSettings).values())
    assert (counts, engines) == ({"tracker": 2, "replica": 1, "router": 2}, 4)
    # the two trackers take part in one election (else both would apply every stream)
    leases = {(s.lease_ttl_s, s.election) for s in of_kind(TrackerSettings).values()}
    assert len(leases) == 1 and next(iter(leases))[0] > 0
    assert SERVICES["redis"]["image"].split(":")[0] == "redis"
    assert SERVICES["haproxy"]["image"].split(":")[0] == "haproxy"


def test_every_redis_url_points_at_the_redis_service() -> None:
    for name in KVROUTER_SERVICES:
        settings = parsed(name).settings
        assert settings.redis, f"{name} does not use Redis"
        url = urlsplit(settings.redis)
        assert (url.scheme, url.hostname, url.port or REDIS_PORT) == (
            "redis",
            "redis",
            REDIS_PORT,
        ), f"{name}: {settings.redis}"
    redis_command = [str(a) for a in SERVICES["redis"].get("command", [])]
    assert "--port" not in redis_command  # the URLs assume the default port


def test_services_listen_beyond_their_own_loopback() -> None:
    for name, settings in of_kind(RouterSettings).items():
        assert settings.host in WILDCARD_HOSTS, name
    for name, settings in of_kind(TrackerSettings).items():
        assert settings.http_host in WILDCARD_HOSTS, name
    for name, settings in of_kind(ReplicaSettings).items():
        assert settings.host in WILDCARD_HOSTS, name


def test_engines_register_endpoints_the_other_containers_reach() -> None:
    for name, settings in of_kind(ReplicaSettings).items():
        # vLLM's rule: a PUB socket binds only on a wildcard host, else it connects out
        for endpoint in (settings.events, settings.replay):
            assert endpoint is not None
            assert tcp_parts(endpoint, "endpoint")[0] in WILDCARD_HOSTS, endpoint
        # the host FleetService writes into the registry records is the service's name
        assert FleetService(settings).advertise_host == name


def test_router_ports_match_the_haproxy_backends() -> None:
    routers = {name: (name, s.port) for name, s in of_kind(RouterSettings).items()}
    servers = haproxy_backend_servers()
    assert sorted(servers.values()) == sorted(routers.values())
    assert set(servers) == set(routers)  # server names are the service names, for the logs
    # the spares (used only when every router fails its check) are the same routers
    assert set(haproxy_backend_servers(backup=True).values()) <= set(routers.values())


def test_only_haproxy_is_published_to_the_host() -> None:
    published = {name for name, svc in SERVICES.items() if svc.get("ports")}
    assert published == {"haproxy"}
    assert not any(svc.get("network_mode") == "host" for svc in SERVICES.values())
    (mapping,) = SERVICES["haproxy"]["ports"]
    host_ip, host_port, container_port = str(mapping).split(":")
    assert host_ip == "127.0.0.1"
    assert int(container_port) == haproxy_frontend_port()
    assert int(host_port) > 0


def test_haproxy_mounts_the_config_read_only() -> None:
    assert f"./deploy/haproxy.cfg:{HAPROXY_CFG_IN_IMAGE}:ro" in SERVICES["haproxy"]["volumes"]


def test_haproxy_may_open_the_file_descriptors_its_maxconn_needs() -> None:
    # haproxy wants ~2 descriptors per connection and refuses to start when the container's
    # limit cannot be raised that far (a default of 20000 or 1024 is common)
    match = re.search(r"^global\b.*?^\s+maxconn\s+(\d+)", HAPROXY_CFG.read_text(), re.M | re.S)
    assert match, "deploy/haproxy.cfg sets no global maxconn"
    nofile = SERVICES["haproxy"]["ulimits"]["nofile"]
    assert min(nofile["soft"], nofile["hard"]) >= 2 * int(match[1]) + 1000


def test_dependencies_wait_for_health() -> None:
    for name, service in SERVICES.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert spec == {"condition": "service_healthy"}, f"{name} -> {dependency}"
            assert "healthcheck" in SERVICES[dependency], f"{dependency} has no healthcheck"
    assert set(SERVICES["haproxy"]["depends_on"]) == set(of_kind(RouterSettings))


def test_healthchecks_probe_the_port_each_service_serves() -> None:
    expected: dict[str, int] = {}
    for name, s in of_kind(RouterSettings).items():
        expected[name] = s.port
    for name, s in of_kind(TrackerSettings).items():
        expected[name] = s.http_port
    for name, s in of_kind(ReplicaSettings).items():
        expected[name] = s.port + s.count - 1  # the last engine to start
    for name, port in expected.items():
        url = urlsplit(environment(SERVICES[name])["HEALTHCHECK_URL"])
        assert (url.hostname, url.port, url.path) == ("127.0.0.1", port, "/health"), name
    assert SERVICES["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


# --------------------------------------------------------------------- Dockerfile


def exec_form(instruction: str) -> list[str]:
    """The JSON (exec) form of an instruction; HEALTHCHECK: of its ``CMD``."""
    text = last(instruction)
    if instruction == "HEALTHCHECK":
        text = text.partition(" CMD ")[2]
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), instruction
    return value


def copy_sources() -> set[str]:
    """What the Dockerfile copies from the build context (not from other stages)."""
    sources: set[str] = set()
    for keyword, rest in DOCKER:
        words = rest.split()
        if keyword == "COPY" and not any(w.startswith("--from") for w in words):
            sources.update(w.rstrip("/") for w in words[:-1] if not w.startswith("--"))
    return sources


def test_dockerfile_entrypoint_and_cmd_agree_with_the_compose_services() -> None:
    assert exec_form("ENTRYPOINT") == ["kvrouter"]
    default = parse_command(exec_form("CMD"), {})
    assert isinstance(default.settings, RouterSettings)
    assert default.settings.host in WILDCARD_HOSTS
    exposed = {int(p.split("/")[0]) for p in last("EXPOSE").split()}
    assert default.settings.port in exposed
    assert {s.http_port for s in of_kind(TrackerSettings).values()} <= exposed
    for name in KVROUTER_SERVICES:
        service = SERVICES[name]
        assert service.get("entrypoint") in (None, ["kvrouter"]), name
        assert service["build"] in (".", {"context": "."}), name
    assert len({SERVICES[n].get("image") for n in KVROUTER_SERVICES}) == 1


def test_dockerfile_builds_on_python_slim_and_runs_unprivileged() -> None:
    stage = final_stage()
    assert stage[0][1].split()[0] == "python:3.11-slim"
    assert all(rest.split()[0] == "python:3.11-slim" for kw, rest in DOCKER if kw == "FROM")
    user = last("USER").split(":")[0]
    assert user not in ("root", "0"), user
    assert [kw for kw, _ in stage].count("USER") == 1


def test_the_image_holds_every_package_an_entry_point_names() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = [
        project["scripts"]["kvrouter"],
        *project["entry-points"]["kvrouter.commands"].values(),
    ]
    packages = {target.split(":")[0].split(".")[0] for target in targets}
    copied = copy_sources()
    assert packages <= copied, f"not copied into the image: {packages - copied}"
    assert {"pyproject.toml", "README.md"} <= copied  # README: the package's description
    # .dockerignore is an allowlist: everything copied must be let back in
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    for source in copied:
        assert f"!{source}" in patterns or f"!{source}/" in patterns, source
        assert (ROOT / source).exists(), source


# --------------------------------------------------------------------- health probe


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def healthcheck_code() -> dict[str, str]:
    """The ``python -c`` program of the image's HEALTHCHECK and of the compose services."""
    image = exec_form("HEALTHCHECK")
    compose = COMPOSE["x-kvrouter"]["healthcheck"]["test"]
    assert image[:2] == ["python", "-c"] and compose[:3] == ["CMD", "python", "-c"]
    return {"image": image[2], "compose": compose[3]}


def test_the_health_probe_needs_only_python_and_fails_on_errors(health_server: str) -> None:
    codes = healthcheck_code()
    assert codes["image"] == codes["compose"]
    env_default = [rest for kw, rest in DOCKER if kw == "ENV" and "HEALTHCHECK_URL" in rest]
    assert env_default, "the image sets no default HEALTHCHECK_URL"
    base = {k: v for k, v in os.environ.items() if k != "HEALTHCHECK_URL"}
    for url, healthy in (
        (f"{health_server}/health", True),
        (f"{health_server}/down", False),
        ("http://127.0.0.1:9/health", False),  # nothing listens
    ):
        result = subprocess.run(
            [sys.executable, "-I", "-c", codes["image"]],
            env=base | {"HEALTHCHECK_URL": url},
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert (result.returncode == 0) == healthy, (url, result.stderr[-500:])
        assert result.returncode in (0, 1)  # docker: 0 healthy, 1 unhealthy, others reserved


# --------------------------------------------------------------------- external validators


def test_haproxy_accepts_its_config() -> None:
    binary = shutil.which("haproxy")
    if binary is None:
        pytest.skip("haproxy is not installed (scripts/install installs it)")
    result = subprocess.run(
        [binary, "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # the service names do not resolve outside compose; init-addr lets haproxy start anyway
    warnings = [
        line
        for line in output.splitlines()
        if "WARNING" in line and "could not resolve address" not in line
    ]
    assert not warnings, "\n".join(warnings)


def compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy is not None else None


def test_docker_compose_accepts_the_file() -> None:
    client = compose_client()
    if client is None:
        pytest.skip("no compose client: neither the `docker compose` plugin nor docker-compose")
    # `config` validates and resolves the file on the client side; no engine is contacted
    result = subprocess.run(
        [*client, "-f", str(COMPOSE_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------- the vLLM variant (docs)


def vllm_snippet() -> dict[str, Any]:
    """The Compose services of docs/deployment.md that replace the simulated engines."""
    match = re.search(
        r"<!-- compose:vllm:begin -->\s*```yaml\n(.*?)```\s*<!-- compose:vllm:end -->",
        DEPLOYMENT_DOC.read_text(),
        re.S,
    )
    assert match, "docs/deployment.md lost its vLLM compose block"
    snippet: dict[str, Any] = yaml.safe_load(match[1])
    return snippet


def same_argument(a: str, b: str) -> bool:
    if a.startswith("{") and b.startswith("{"):
        return bool(json.loads(a) == json.loads(b))
    return a == b


def contains_run(argv: list[str], run: list[str]) -> bool:
    return any(
        all(same_argument(x, y) for x, y in zip(argv[i : i + len(run)], run, strict=True))
        for i in range(len(argv) - len(run) + 1)
    )


def test_the_vllm_variant_in_the_docs_is_consistent() -> None:
    services: dict[str, dict[str, Any]] = vllm_snippet()["services"]
    kvrouter = {
        name: parse_command([str(a) for a in svc["command"]], environment(svc)).settings
        for name, svc in services.items()
        if str(svc.get("image", "")).startswith("kvrouter")
    }
    attaches = {n: s for n, s in kvrouter.items() if isinstance(s, AttachSettings)}
    routers = {n: s for n, s in kvrouter.items() if isinstance(s, RouterSettings)}
    assert attaches and routers
    for name, settings in attaches.items():
        settings.require_attach()
        assert services[name]["healthcheck"] == {"disable": True}  # attach serves no HTTP
        assert urlsplit(settings.redis).hostname == "redis"
        url = urlsplit(settings.url)
        vllm = services[str(url.hostname)]
        for endpoint in (settings.events, settings.replay):
            assert endpoint is not None and tcp_parts(endpoint, name)[0] == url.hostname
        # vLLM runs exactly the flags `kvrouter attach --print-flags` gives for these settings
        argv = [str(a) for a in vllm["command"]]
        assert contains_run(argv, vllm_flags(settings)), (argv, vllm_flags(settings))
        assert f"--port={url.port}" in argv
        assert environment(vllm) | vllm_env(settings) == environment(vllm)
    vllm_models = {
        str(services[str(urlsplit(str(a.url)).hostname)]["command"][0]) for a in attaches.values()
    }
    for name, router in routers.items():
        assert urlsplit(router.redis).hostname == "redis"
        assert router.host in WILDCARD_HOSTS
        # the routers tokenize with the files vLLM serves (mounted read-only)
        (tokenizer,) = router.tokenizer
        assert vllm_models == {tokenizer}
        assert any(
            tokenizer.startswith(v.split(":")[1]) and v.endswith(":ro")
            for v in services[name]["volumes"]
        )
        assert "engines" not in services[name]["depends_on"]
        health = urlsplit(environment(services[name])["HEALTHCHECK_URL"])
        assert (health.port, health.path) == (router.port, "/health")
