"""Static checks of docker-compose.yml and deploy/haproxy.cfg.

No Docker engine is needed: every kvrouter command in the compose file is parsed by
kvrouter's own argument parser and settings classes (so a renamed flag fails here), the
addresses that tie the services together are compared with each other, haproxy checks its
own configuration, and `docker compose config` runs where a compose client is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest

from publishers.config import WILDCARD_HOSTS, ReplicaSettings, tcp_parts
from publishers.sim.fleet import FleetService
from router.config import RouterSettings
from tests.deployment import (
    COMPOSE_FILE,
    KVROUTER_SERVICES,
    ROOT,
    SERVICES,
    environment,
    of_kind,
    parsed,
)
from tracker.ingest.config import TrackerSettings

HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
HAPROXY_CFG_IN_IMAGE = "/usr/local/etc/haproxy/haproxy.cfg"
REDIS_PORT = 6379


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
