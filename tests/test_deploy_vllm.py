"""The vLLM variant of the compose stack in docs/deployment.md, checked against kvrouter."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlsplit

import yaml

from publishers.config import WILDCARD_HOSTS, AttachSettings, tcp_parts
from publishers.vllm import vllm_env, vllm_flags
from router.config import RouterSettings
from tests.deployment import ROOT, environment, parse_command

DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"


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
