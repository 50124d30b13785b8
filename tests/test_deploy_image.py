"""Static checks of the Dockerfile and .dockerignore, and the image's health probe run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from publishers.config import WILDCARD_HOSTS
from router.config import RouterSettings
from tests.deployment import COMPOSE, KVROUTER_SERVICES, ROOT, SERVICES, of_kind, parse_command
from tracker.ingest.config import TrackerSettings

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


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
