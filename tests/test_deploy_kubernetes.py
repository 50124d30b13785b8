"""Static checks of the Kubernetes manifests in deploy/kubernetes.

No cluster is needed. Both kustomizations (the GIE gateway mode at the root, the proxy mode in
``proxy/``) are rendered here in Python, and by ``kubectl kustomize`` where kubectl is
installed (the two must agree); every core resource is validated against the Kubernetes API's
own schemas (kubernetes-validate, strict: an unknown field fails), the InferencePool and the
HTTPRoute against their CRDs' schemas (tests/data/gie); every kvrouter command is parsed by
kvrouter's own argument parser with the environment the pod would give it (``valueFrom`` and
``$(VAR)`` expanded as the kubelet does, the pod's IP from the downward API); and the
addresses that tie the pieces together are compared with each other.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from publishers.config import WILDCARD_HOSTS, AttachSettings, tcp_parts
from publishers.vllm import OWNER_ENV, attach_record, kv_events_config, vllm_env, vllm_flags
from router.config import RouterSettings
from tests.deployment import ROOT, SERVICES, Parsed, parse_command
from tracker.framework.cli import load_commands
from tracker.ingest.config import TrackerSettings

KUBE_DIR = ROOT / "deploy" / "kubernetes"
CRD_DIR = ROOT / "tests" / "data" / "gie"
# the oldest Kubernetes the pyproject's kubernetes-validate (>= 1.31) has schemas for; gRPC
# probes, the newest feature the manifests use, are GA since 1.27
KUBERNETES_VERSION = "1.31.0"
MODES = {"gateway": KUBE_DIR, "proxy": KUBE_DIR / "proxy"}
KVROUTER_IMAGE = SERVICES["tracker"]["image"]  # the compose file's tag of the Dockerfile's image
REDIS_PORT = 6379
# the downward API's answers for a pod the tests imagine
POD = {
    "status.podIP": "10.0.3.7",
    "metadata.name": "vllm-6b9f7d8c5d-x7k2q",
    "metadata.namespace": "default",
}

Resource = dict[str, Any]


# --------------------------------------------------------------------- rendering


def render(directory: Path) -> list[Resource]:
    """The resources ``kubectl kustomize DIRECTORY`` would print, for the subset of kustomize
    these manifests use: ``resources`` (files and directories with their own kustomization)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - {"apiVersion", "kind", "resources"}
    assert not unsupported, f"{directory}: this test renders no {sorted(unsupported)}"
    out: list[Resource] = []
    for entry in kustomization["resources"]:
        path = (directory / entry).resolve()
        if path.is_dir():
            out += render(path)
        else:
            out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return out


def key(resource: Resource) -> tuple[str, str]:
    return resource["kind"], resource["metadata"]["name"]


RENDERED: dict[str, list[Resource]] = {mode: render(path) for mode, path in MODES.items()}


def of_kind(mode: str, kind: str) -> dict[str, Resource]:
    return {r["metadata"]["name"]: r for r in RENDERED[mode] if r["kind"] == kind}


def one(mode: str, kind: str) -> Resource:
    (resource,) = of_kind(mode, kind).values()
    return resource


# ------------------------------------------------------------- pods, as the kubelet sees them

_REFERENCE = re.compile(r"\$\$|\$\(([-._A-Za-z0-9]+)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, an undefined
    reference is left as written, ``$$`` is a literal ``$``."""

    def substitute(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _REFERENCE.sub(substitute, text)


def lookup(mode: str, kind: str, ref: dict[str, str]) -> str:
    """The value a ``configMapKeyRef`` / ``secretKeyRef`` reads from the rendered objects."""
    found = of_kind(mode, kind).get(ref["name"])
    assert found is not None, f"no {kind} {ref['name']!r}"
    if kind == "Secret" and ref["key"] in found.get("data", {}):
        return base64.b64decode(found["data"][ref["key"]]).decode()
    values = found.get("stringData" if kind == "Secret" else "data", {})
    assert ref["key"] in values, f"{kind} {ref['name']!r} has no key {ref['key']!r}"
    return str(values[ref["key"]])


def container_env(mode: str, container: Resource) -> dict[str, str]:
    """The container's environment, each entry expanded against those before it."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            assert path in POD, f"{var['name']}: this test gives pods no {path}"
            env[var["name"]] = POD[path]
        elif "configMapKeyRef" in source:
            env[var["name"]] = lookup(mode, "ConfigMap", source["configMapKeyRef"])
        else:
            env[var["name"]] = lookup(mode, "Secret", source["secretKeyRef"])
    return env


@dataclass(frozen=True)
class Pod:
    """One container of a Deployment's pod template, with its environment and argv resolved."""

    mode: str
    deployment: Resource
    container: Resource
    env: dict[str, str]
    argv: list[str]  # command + args, expanded

    @property
    def name(self) -> str:
        return str(self.deployment["metadata"]["name"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.deployment["spec"]["template"]["metadata"]["labels"])

    def port(self, name: str) -> int:
        """The container port called ``name``."""
        ports = {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}
        assert name in ports, f"{self.name}: no container port {name!r}"
        return int(ports[name])

    def probe_port(self, probe: Resource) -> int:
        port = next(probe[k]["port"] for k in ("httpGet", "tcpSocket", "grpc") if k in probe)
        return self.port(port) if isinstance(port, str) else int(port)


def pods(mode: str) -> Iterator[Pod]:
    for deployment in of_kind(mode, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            env = container_env(mode, container)
            argv = [expand(str(a), env) for a in container.get("command", []) + container["args"]]
            yield Pod(mode, deployment, container, env, argv)


def pod(mode: str, name: str) -> Pod:
    (found,) = (p for p in pods(mode) if p.name == name)
    return found


def kvrouter_pods() -> list[Pod]:
    """Every container running the kvrouter image, in both modes (the shared ones once)."""
    seen: set[str] = set()
    out = []
    for mode in MODES:
        for p in pods(mode):
            if p.container["image"] == KVROUTER_IMAGE and p.name not in seen:
                seen.add(p.name)
                out.append(p)
    return out


def flag(argv: list[str], name: str) -> str:
    """The value of ``--name=V`` or ``--name V`` in ``argv``."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}":
            return argv[i + 1]
    raise AssertionError(f"no --{name} in {shlex.join(argv)}")


def parse(p: Pod) -> Parsed:
    """``kvrouter ARGS`` as the container would run it; skipped for a command not installed."""
    command = p.argv[0]
    if command not in load_commands():
        pytest.skip(f"`kvrouter {command}` is not on this branch yet (its settings come with it)")
    return parse_command(p.argv, p.env)


def vllm() -> tuple[Pod, AttachSettings]:
    """The vLLM pod and the settings its kvrouter plugin builds from its environment."""
    p = pod("gateway", "vllm")
    return p, AttachSettings.from_env(p.env)


def service_target(mode: str, service: str, port_name: str) -> tuple[Resource, int]:
    """(the Service's port called ``port_name``, the container port it forwards to)."""
    svc = of_kind(mode, "Service")[service]
    (port,) = (p for p in svc["spec"]["ports"] if p["name"] == port_name)
    selected = [p for p in pods(mode) if svc["spec"]["selector"].items() <= p.labels.items()]
    assert len(selected) == 1, f"Service {service} selects {[p.name for p in selected]}"
    target = port.get("targetPort", port["port"])
    return port, selected[0].port(target) if isinstance(target, str) else int(target)


def redis_service_address(mode: str) -> tuple[str, int]:
    """(host, port) clients reach the kustomization's Redis at, through its Service."""
    (name,) = (n for n in of_kind(mode, "Service") if n.endswith("redis"))
    port, container_port = service_target(mode, name, "redis")
    assert container_port == REDIS_PORT  # redis-server's default: the manifest sets no --port
    return name, int(port["port"])


# --------------------------------------------------------------------- the renderings


def kubectl() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` not compared")
    return binary


@pytest.mark.parametrize("mode", sorted(MODES))
def test_kubectl_kustomize_renders_what_the_tests_read(mode: str) -> None:
    result = subprocess.run(
        [kubectl(), "kustomize", str(MODES[mode])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    theirs = {key(r): r for r in yaml.safe_load_all(result.stdout) if r is not None}
    ours = {key(r): r for r in RENDERED[mode]}
    assert len(ours) == len(RENDERED[mode]), "a resource is declared twice"
    assert sorted(theirs) == sorted(ours)
    for name, resource in ours.items():
        assert theirs[name] == resource, name


def test_the_modes_hold_what_they_should() -> None:
    kinds = {mode: sorted({r["kind"] for r in RENDERED[mode]}) for mode in MODES}
    core = ["ConfigMap", "Deployment", "PersistentVolumeClaim", "PodDisruptionBudget"]
    core += ["Secret", "Service"]
    assert kinds == {"gateway": sorted([*core, "HTTPRoute", "InferencePool"]), "proxy": core}
    commands = {
        mode: sorted(p.argv[0] for p in pods(mode) if p.container["image"] == KVROUTER_IMAGE)
        for mode in MODES
    }
    assert commands == {"gateway": ["epp", "tracker"], "proxy": ["router", "tracker"]}


# --------------------------------------------------------------------- schemas


CORE = [
    (mode, key(r)) for mode in MODES for r in RENDERED[mode] if "k8s.io/" not in r["apiVersion"]
]


@pytest.mark.parametrize(("mode", "name"), CORE, ids=[f"{m}-{k}-{n}" for m, (k, n) in CORE])
def test_every_core_resource_is_valid_kubernetes(mode: str, name: tuple[str, str]) -> None:
    (resource,) = (r for r in RENDERED[mode] if key(r) == name)
    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name}: {exc.message} at {'.'.join(map(str, exc.path))}")


def crd_validator(filename: str, version: str) -> jsonschema.protocols.Validator:
    """A validator of the CRD's ``version`` schema that, like the API server's strict field
    validation, refuses fields the schema does not declare (the server would drop them)."""
    crd = yaml.safe_load((CRD_DIR / filename).read_text())
    (served,) = (v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = copy.deepcopy(served["schema"]["openAPIV3Schema"])

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return jsonschema.Draft202012Validator(schema)


CRDS = {
    "InferencePool": ("inference.networking.k8s.io_inferencepools.yaml", "v1"),
    "HTTPRoute": ("gateway.networking.k8s.io_httproutes.yaml", "v1"),
}


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_gateway_resources_match_their_crds(kind: str) -> None:
    filename, version = CRDS[kind]
    resource = one("gateway", kind)
    group = yaml.safe_load((CRD_DIR / filename).read_text())["spec"]["group"]
    assert resource["apiVersion"] == f"{group}/{version}"
    validator = crd_validator(filename, version)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(resource)]
    assert not errors, "\n".join(errors)
    # the validator is strict: an undeclared field is an error
    assert not validator.is_valid({**resource, "spec": {**resource["spec"], "bogus": 1}})


# --------------------------------------------------------------------- kvrouter's commands


KVROUTER_DEPLOYMENTS = sorted(
    {
        d["metadata"]["name"]
        for mode in MODES
        for d in of_kind(mode, "Deployment").values()
        if d["spec"]["template"]["spec"]["containers"][0]["image"] == KVROUTER_IMAGE
    }
)


def kvrouter_pod(name: str) -> Pod:
    (p,) = (p for p in kvrouter_pods() if p.name == name)
    return p


@pytest.mark.parametrize("name", KVROUTER_DEPLOYMENTS)
def test_kvrouter_environment_is_the_commands_own(name: str) -> None:
    # KVROUTER_<COMMAND>_<SETTING>: another command's variable would be ignored silently
    p = kvrouter_pod(name)
    assert "command" not in p.container  # the image's entrypoint is `kvrouter`
    prefix = f"KVROUTER_{p.argv[0].upper()}_"
    strays = [v for v in p.env if v.startswith("KVROUTER_") and not v.startswith(prefix)]
    assert not strays, f"{name} runs `kvrouter {p.argv[0]}`, which reads no {strays}"


@pytest.mark.parametrize("name", KVROUTER_DEPLOYMENTS)
def test_every_kvrouter_command_parses_with_the_real_parser(name: str) -> None:
    p = kvrouter_pod(name)
    result = parse(p)
    settings_names = {result.command.settings.env_name(f) for f in vars(result.settings)}
    unknown = {v for v in p.env if v.startswith("KVROUTER_") and v not in settings_names}
    assert not unknown, f"{name}: environment variables no setting reads: {unknown}"


def test_kvrouter_pods_run_the_compose_files_image() -> None:
    assert KVROUTER_IMAGE == "kvrouter:local"
    assert set(KVROUTER_DEPLOYMENTS) == {"kvrouter-tracker", "kvrouter-epp", "kvrouter-router"}
    # the vLLM image is the one vllm.Dockerfile says to build
    dockerfile = (KUBE_DIR / "vllm.Dockerfile").read_text()
    p, _ = vllm()
    assert f"-f deploy/kubernetes/vllm.Dockerfile -t {p.container['image']} ." in dockerfile
    assert re.search(r"^RUN python3 -m pip install .*/tmp/kvrouter", dockerfile, re.M)


def copied_sources(dockerfile: Path) -> set[str]:
    """What the Dockerfile's COPY lines take from the build context."""
    out: set[str] = set()
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            out |= {w.rstrip("/") for w in words[1:-1]}
    return out


def test_the_vllm_image_installs_what_the_kvrouter_image_does() -> None:
    # the plugin's entry point and its imports come from the same packages
    assert copied_sources(KUBE_DIR / "vllm.Dockerfile") == copied_sources(ROOT / "Dockerfile")


def test_kvrouter_services_listen_beyond_their_own_loopback() -> None:
    for p in kvrouter_pods():
        host_flag = "http-host" if p.argv[0] == "tracker" else "host"
        assert flag(p.argv, host_flag) in WILDCARD_HOSTS, p.name
    p, _ = vllm()
    assert flag(p.argv, "host") in WILDCARD_HOSTS


def test_every_redis_url_points_at_the_redis_service() -> None:
    for mode in MODES:
        host, port = redis_service_address(mode)
        for p in pods(mode):
            if p.name.endswith("redis"):
                continue
            # the vLLM plugin reads the attach settings, the others their own command's
            part = "ATTACH" if p.name == "vllm" else p.argv[0].upper()
            assert f"KVROUTER_{part}_REDIS" in p.env, p.name
            url = urlsplit(p.env[f"KVROUTER_{part}_REDIS"])
            assert (url.scheme, url.hostname, url.port or REDIS_PORT) == ("redis", host, port)


def test_redis_keeps_the_index_and_nothing_on_disk() -> None:
    argv = pod("gateway", "kvrouter-redis").argv
    assert argv[0] == "redis-server"
    assert flag(argv, "maxmemory-policy") == "noeviction"
    assert (flag(argv, "save"), flag(argv, "appendonly")) == ("", "no")
    assert "--port" not in argv


def test_shared_references_resolve() -> None:
    for mode in MODES:
        claims = of_kind(mode, "PersistentVolumeClaim")
        for p in pods(mode):  # valueFrom was resolved by building p.env
            for volume in p.deployment["spec"]["template"]["spec"].get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in claims, p.name
        for name, svc in of_kind(mode, "Service").items():
            for port in svc["spec"]["ports"]:
                service_target(mode, name, port["name"])
        deployments = of_kind(mode, "Deployment").values()
        for name, pdb in of_kind(mode, "PodDisruptionBudget").items():
            labels = pdb["spec"]["selector"]["matchLabels"].items()
            matching = [
                d
                for d in deployments
                if labels <= d["spec"]["template"]["metadata"]["labels"].items()
            ]
            assert len(matching) == 1, f"PodDisruptionBudget {name}"
            assert matching[0]["spec"]["replicas"] > pdb["spec"]["minAvailable"], name


# --------------------------------------------------------------------- the tracker


def test_two_trackers_share_one_election() -> None:
    p = pod("gateway", "kvrouter-tracker")
    settings = parse(p).settings
    assert isinstance(settings, TrackerSettings)
    assert p.deployment["spec"]["replicas"] == 2
    assert settings.lease_ttl_s > 0  # else both would apply every stream, unfenced
    assert settings.http_host in WILDCARD_HOSTS
    assert p.port("http") == settings.http_port
    for probe in ("livenessProbe", "readinessProbe"):
        assert p.probe_port(p.container[probe]) == settings.http_port, probe
    assert p.container["readinessProbe"]["httpGet"]["path"] == "/health"
    # /health is 503 while Redis is down: a liveness probe on it would restart the tracker and
    # lose the ledgers it rewrites Redis from
    assert p.container["livenessProbe"]["httpGet"]["path"] != "/health"


# --------------------------------------------------------------------- vLLM


def test_vllm_runs_with_the_flags_its_registration_expects() -> None:
    p, settings = vllm()
    assert p.argv[:2] == ["vllm", "serve"]
    args = p.argv[2:]
    assert args[0] == lookup(
        "gateway", "ConfigMap", {"name": "kvrouter-config", "key": "model-path"}
    )
    expected = vllm_flags(settings)
    at = args.index(expected[0])
    given = args[at : at + len(expected)]
    # the JSON compared as JSON, every other word exactly
    events = expected.index("--kv-events-config") + 1
    assert json.loads(given[events]) == kv_events_config(settings)
    assert given[:events] + given[events + 1 :] == expected[:events] + expected[events + 1 :]
    assert vllm_env(settings).items() <= p.env.items()


def test_vllm_registers_the_address_the_picker_names() -> None:
    p, settings = vllm()
    settings.require_attach()
    record = attach_record(settings, "instance")  # what the plugin writes to the registry
    assert record.id == POD["metadata.name"]
    url = urlsplit(record.url or "")
    assert (url.scheme, url.hostname, url.port, url.path) == (
        "http",
        POD["status.podIP"],
        p.port("http"),
        "",
    )
    assert int(flag(p.argv, "port")) == p.port("http")
    assert tcp_parts(record.events or "", "events") == (POD["status.podIP"], p.port("kv-events"))
    assert tcp_parts(record.replay or "", "replay") == (POD["status.podIP"], p.port("kv-replay"))
    # vLLM binds those ports on every address (kv_events_config turns the host into '*')
    assert settings.model == lookup(
        "gateway", "ConfigMap", {"name": "kvrouter-config", "key": "model"}
    )
    assert OWNER_ENV not in p.env  # vLLM's API server sets it for its children
    unknown = {v for v in p.env if v.startswith("KVROUTER_ATTACH_")}
    unknown -= {AttachSettings.env_name(f) for f in vars(settings)}
    assert not unknown


def test_vllm_gets_a_gpu_and_is_probed_on_health() -> None:
    p, _ = vllm()
    resources = p.container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] >= 1
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert p.container[probe]["httpGet"]["path"] == "/health", probe
        assert p.probe_port(p.container[probe]) == p.port("http"), probe


# --------------------------------------------------------------------- the gateway mode


def epp_ports(p: Pod) -> dict[str, int]:
    """The picker's ports: its settings once `kvrouter epp` exists, its flags until then."""
    if "epp" in load_commands():
        s = parse(p).settings
        return {"grpc": s.grpc_port, "health": s.health_port, "http": s.port}
    return {
        "grpc": int(flag(p.argv, "grpc-port")),
        "health": int(flag(p.argv, "health-port")),
        "http": int(flag(p.argv, "port")),
    }


def test_inference_pool_selects_the_vllm_pods_and_their_serving_port() -> None:
    pool = one("gateway", "InferencePool")["spec"]
    selector = pool["selector"]["matchLabels"].items()
    selected = [p.name for p in pods("gateway") if selector <= p.labels.items()]
    assert selected == ["vllm"]
    p, settings = vllm()
    assert [t["number"] for t in pool["targetPorts"]] == [p.port("http")]
    assert urlsplit(settings.url or "").port == p.port("http")


def test_endpoint_picker_ref_is_the_pickers_ext_proc_port() -> None:
    ref = one("gateway", "InferencePool")["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["failureMode"] == "FailClose"
    svc = of_kind("gateway", "Service")[ref["name"]]
    (port,) = (p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    _, container_port = service_target("gateway", ref["name"], port["name"])
    p = pod("gateway", "kvrouter-epp")
    ports = epp_ports(p)
    assert container_port == ports["grpc"]
    assert port["appProtocol"] == "http2"
    # the health and metrics ports are on the Service too, each to the port the picker serves
    served = {service_target("gateway", ref["name"], q["name"])[1] for q in svc["spec"]["ports"]}
    assert served == set(ports.values())


def test_pickers_are_all_active_and_probed_over_grpc_health() -> None:
    p = pod("gateway", "kvrouter-epp")
    assert p.deployment["spec"]["replicas"] >= 2
    health = epp_ports(p)["health"]
    for probe, service in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        assert p.container[probe]["grpc"] == {"port": health, "service": service}
    assert p.port("grpc-health") == health


def test_httproute_sends_the_openai_api_to_the_pool() -> None:
    route = one("gateway", "HTTPRoute")["spec"]
    (parent,) = route["parentRefs"]
    assert (parent.get("kind", "Gateway"), parent["name"]) == ("Gateway", "inference-gateway")
    (rule,) = route["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    (backend,) = rule["backendRefs"]
    pool = one("gateway", "InferencePool")
    assert (backend["group"], backend["kind"], backend["name"]) == (
        pool["apiVersion"].split("/")[0],
        "InferencePool",
        pool["metadata"]["name"],
    )


# --------------------------------------------------------------------- the proxy mode


def test_proxy_routers_serve_their_service_port() -> None:
    p = pod("proxy", "kvrouter-router")
    settings = parse(p).settings
    assert isinstance(settings, RouterSettings)
    assert settings.host in WILDCARD_HOSTS and settings.discover and settings.redis
    assert p.deployment["spec"]["replicas"] >= 2
    _, target = service_target("proxy", "kvrouter-router", "http")
    assert target == settings.port
    assert p.container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert p.probe_port(p.container["readinessProbe"]) == settings.port
    # the router's shutdown drain fits in the pod's grace period
    grace = p.deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.shutdown_timeout_s
