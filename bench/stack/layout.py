"""The local stack laid out: its loopback ports, where each of its processes listens, and the
command line each is started with (redis-server and Sentinels, engines, trackers, routers and
haproxy)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.stack.config import Gateway, StackConfig
from bench.stack.envoy import BodyMode, EnvoyConfig, EnvoyError, ExtProc, Upstream, envoy_argv
from bench.stack.ports import free_ports
from bench.stack.processes import ProcessSpec, StackError
from bench.stack.redis_servers import SENTINEL_SERVICE, redis_server_argv, sentinel_config


def kvrouter_bin() -> str:
    """The ``kvrouter`` console script of this interpreter's environment."""
    candidate = Path(sys.executable).parent / "kvrouter"
    return str(candidate) if candidate.exists() else "kvrouter"


def gateway_envoy(
    gateway: Gateway, *, port: int, admin_port: int, epps: Sequence[str], engines: Sequence[str]
) -> EnvoyConfig:
    """A :class:`Gateway`'s Envoy on ``port``: it asks the pickers at ``epps`` (gRPC
    ``host:port``, round robin; none: Envoy alone) and sends each request to the engines
    (``host:port``) the answer names, the next one on a retry."""
    body: BodyMode = "FULL_DUPLEX_STREAMED" if gateway.response_body else "NONE"
    ext_proc = None
    if epps:
        ext_proc = ExtProc(
            epps=tuple(epps),
            tls=gateway.tls,
            failure_mode_allow=gateway.fail_open,
            request_body_mode="BUFFERED" if gateway.buffered else "FULL_DUPLEX_STREAMED",
            request_trailer_mode="SKIP" if gateway.buffered else "SEND",
            response_body_mode=body,
            response_trailer_mode="SEND" if gateway.response_body else "SKIP",
            # a killed picker is out of the round robin within a second (kvrouter epp answers
            # grpc.health.v1 for the ext_proc service on its ext_proc port)
            health_check_interval_s=1.0,
        )
    return EnvoyConfig(
        port=port,
        admin_port=admin_port,
        upstream=Upstream.OVERRIDE_HOST,
        engines=tuple(engines),
        ext_proc=ext_proc,
    )


def picker_flags(gateway: Gateway, grpc_port: int, health_port: int) -> list[str]:
    """A ``kvrouter epp``'s own flags behind ``gateway``: its ports, and plaintext when the
    gateway connects so."""
    ports = ["--grpc-port", str(grpc_port), "--health-port", str(health_port)]
    return ports if gateway.tls else [*ports, "--no-secure-serving"]


class StackLayout:
    """The stack's ports and addresses, known after construction, and the command line of each
    of its processes (:class:`~bench.stack.local.LocalStack` starts them).

    :param workdir: where the processes' own files go (haproxy's and the Sentinels' configs,
        the Redis replica's directory).
    """

    def __init__(self, config: StackConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        cfg = config
        n = cfg.replicas
        pickers = 2 * cfg.routers + 1 if cfg.gateway is not None else 0
        base = free_ports(4 + 3 * n + 2 * cfg.routers + (4 if cfg.sentinel else 0) + pickers)
        self.redis_port = base
        self.haproxy_port = base + 1
        self.tracker_port = base + 2
        self.standby_tracker_port = base + 3
        self.replica_port = base + 4
        self.events_port = self.replica_port + n
        self.replay_port = self.events_port + n
        self.router_ports = [self.replay_port + n + i for i in range(cfg.routers)]
        # spare ports beside each router's, for what replaces it (a peer's metrics server)
        self.spare_ports = [p + cfg.routers for p in self.router_ports]
        after = self.replay_port + n + 2 * cfg.routers
        self.redis_replica_port = after if cfg.sentinel else None
        self.sentinel_ports = [after + 1 + i for i in range(3)] if cfg.sentinel else []
        # with a gateway: each picker's ext_proc and health ports, and Envoy's admin port
        after += 4 if cfg.sentinel else 0
        self.grpc_ports = [after + i for i in range(cfg.routers)] if pickers else []
        self.health_ports = [after + cfg.routers + i for i in range(cfg.routers)] if pickers else []
        self.envoy_admin_port = after + 2 * cfg.routers if pickers else None

    # ------------------------------------------------------------------ addresses

    @property
    def redis_url(self) -> str | None:
        if not self.config.redis:
            return None
        if self.sentinel_ports:
            hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
            return f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}/0"
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def router_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.router_ports]

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.replica_port + i}" for i in range(self.config.replicas)]

    @property
    def entry_url(self) -> str:
        """Where clients connect: Envoy or haproxy when there is one, else the first router."""
        cfg = self.config
        if cfg.gateway is not None or (cfg.haproxy and cfg.routers > 1):
            return f"http://127.0.0.1:{self.haproxy_port}"
        return self.router_urls[0]

    @property
    def router_names(self) -> list[str]:
        """The routers' process names: ``router-i``, or ``epp-i`` behind a gateway."""
        kind = "epp" if self.config.gateway is not None else "router"
        return [f"{kind}-{i}" for i in range(self.config.routers)]

    @property
    def replica_ids(self) -> list[str]:
        """Engine ids, in port order."""
        if self.config.replica_processes:
            return [f"replica-{i}-0" for i in range(self.config.replicas)]
        return [f"replica-{i}" for i in range(self.config.replicas)]

    def replica_specs(self) -> list[str]:
        """``--replica`` flags for the engines (used without Redis)."""
        return [
            f"{self.replica_ids[i]}=tcp://127.0.0.1:{self.events_port + i},"
            f"replay=tcp://127.0.0.1:{self.replay_port + i},url={url}"
            for i, url in enumerate(self.replica_urls)
        ]

    # ------------------------------------------------------------------ processes

    def processes(self) -> list[ProcessSpec]:
        """Every process of the stack, in start order; writes the config files they read.

        :raises StackError: redis-server or haproxy, when the stack needs it, is not installed.
        """
        cfg, kv = self.config, kvrouter_bin()
        out: list[ProcessSpec] = []
        redis_flags = ["--redis", self.redis_url] if self.redis_url else []
        if cfg.redis:
            try:
                argv = redis_server_argv(self.redis_port, self.workdir)
            except RuntimeError as exc:
                raise StackError(str(exc)) from None
            out.append(ProcessSpec("redis", argv, port=self.redis_port))
            if self.redis_replica_port is not None:
                out += self._sentinels(argv[0])
        if cfg.vllm is not None:
            for i in range(cfg.replicas):
                argv = cfg.vllm.argv(
                    cfg.model,
                    cfg.block_size,
                    self.replica_port + i,
                    self.events_port + i,
                    self.replay_port + i,
                    index=i,
                )
                env = dict(cfg.vllm.env)
                if cfg.vllm.attach and self.redis_url:
                    # the shim inside vLLM heartbeats the registry entry (publishers/vllm.py)
                    env |= {
                        "KVROUTER_ATTACH_REDIS": self.redis_url,
                        "KVROUTER_ATTACH_ID": self.replica_ids[i],
                        "KVROUTER_ATTACH_URL": self.replica_urls[i],
                        "KVROUTER_ATTACH_EVENTS": f"tcp://127.0.0.1:{self.events_port + i}",
                        "KVROUTER_ATTACH_REPLAY": f"tcp://127.0.0.1:{self.replay_port + i}",
                        "KVROUTER_ATTACH_MODEL": cfg.model,
                        "KVROUTER_ATTACH_BLOCK_SIZE": str(cfg.block_size),
                        "KVROUTER_ATTACH_HEARTBEAT_S": "1",
                        "KVROUTER_ATTACH_TTL_S": "5",
                    }
                out.append(ProcessSpec(f"vllm-{i}", argv, f"{self.replica_urls[i]}/health", env))
        else:
            groups = (
                [(f"replica-{i}", i, 1) for i in range(cfg.replicas)]
                if cfg.replica_processes
                else [("replicas", 0, cfg.replicas)]
            )
            for name, first, count in groups:
                ids = ["--id-prefix", f"replica-{first}-"] if cfg.replica_processes else []
                out.append(self._replicas(name, first, count, [*ids, *redis_flags]))
        # engines nobody registers are given to every process
        static = not cfg.redis or (cfg.vllm is not None and not cfg.vllm.attach)
        every = [f for s in self.replica_specs() for f in ("--replica", s)]
        specs = every if static else []
        vllm_flags = []
        if cfg.vllm is not None:
            model = str(cfg.vllm.model)
            vllm_flags = ["--tokenizer", model, "--chat-template", f"{model}/tokenizer_config.json"]
        if cfg.redis:
            tracker = [kv, "tracker", *redis_flags, "--http-port", str(self.tracker_port)]
            if static:
                tracker += ["--model", cfg.model, "--block-size", str(cfg.block_size), *specs]
            out += self._trackers([*tracker, *cfg.tracker_args])
        if cfg.local_index and cfg.redis:
            specs = ["--local-index", *every]
        out += self._routers([*redis_flags, *specs, *vllm_flags])
        if cfg.gateway is not None:
            out.append(self._envoy())
        elif cfg.haproxy and cfg.routers > 1:
            out.append(ProcessSpec("haproxy", self._haproxy_argv()))
        return out

    def _routers(self, flags: list[str]) -> list[ProcessSpec]:
        """The routers (or endpoint pickers), each with ``flags`` after its own."""
        cfg, out = self.config, []
        for i, port in enumerate(self.router_ports):
            name = self.router_names[i]
            router = ProcessSpec(
                name,
                [
                    kvrouter_bin(),
                    "epp" if cfg.gateway is not None else "router",
                    "--port",
                    str(port),
                    "--router-id",
                    name,
                    "--model",
                    cfg.model,
                    "--block-size",
                    str(cfg.block_size),
                    *flags,
                    *self._picker_flags(i),
                    *cfg.router_args,
                ],
                f"http://127.0.0.1:{port}/health",
            )
            out.append(router)
        return out

    def _picker_flags(self, i: int) -> list[str]:
        gateway = self.config.gateway
        if gateway is None:
            return []
        return picker_flags(gateway, self.grpc_ports[i], self.health_ports[i])

    def envoy_config(self, gateway: Gateway | None = None) -> EnvoyConfig:
        """The gateway: Envoy on the entry port, asking every picker (round robin), sending
        each request to the engines the answer names, the next one on a retry.

        :param gateway: another gateway's options in front of the same pickers and engines
            (a second Envoy, on other ports, to compare modes); None: the stack's.
        """
        gateway = gateway or self.config.gateway
        assert gateway is not None and self.envoy_admin_port is not None
        return gateway_envoy(
            gateway,
            port=self.haproxy_port,
            admin_port=self.envoy_admin_port,
            epps=[f"127.0.0.1:{port}" for port in self.grpc_ports],
            engines=[url.removeprefix("http://") for url in self.replica_urls],
        )

    def _envoy(self) -> ProcessSpec:
        try:
            path = self.envoy_config().write(self.workdir / "envoy.json")
            argv = envoy_argv(path)
        except EnvoyError as exc:
            raise StackError(str(exc)) from None
        return ProcessSpec("envoy", argv, f"http://127.0.0.1:{self.envoy_admin_port}/ready")

    def _replicas(self, name: str, first: int, count: int, flags: list[str]) -> ProcessSpec:
        cfg = self.config
        return ProcessSpec(
            name,
            [
                kvrouter_bin(),
                "replica",
                "--count",
                str(count),
                "--port",
                str(self.replica_port + first),
                # vLLM's rule: a PUB on a named host connects out, only a wildcard binds;
                # the registered endpoints use --host (127.0.0.1) all the same
                "--events",
                f"tcp://*:{self.events_port + first}",
                "--replay",
                f"tcp://127.0.0.1:{self.replay_port + first}",
                "--model",
                cfg.model,
                *cfg.replica_flags(),
                *flags,
                *cfg.replica_args,
            ],
            f"{self.replica_urls[first + count - 1]}/health",
        )

    def _haproxy_argv(self) -> list[str]:
        binary = shutil.which("haproxy")
        if binary is None:
            raise StackError("haproxy is not installed (scripts/install installs it)")
        servers = "\n".join(
            f"    server router-{i} 127.0.0.1:{p} check inter 500ms fall 2 rise 2"
            for i, p in enumerate(self.router_ports)
        )
        # as deploy/haproxy.cfg: when every router is out (each answers /health 503 because
        # no engine is up), connections still reach them and get a fast OpenAI 503 instead of
        # being cut by haproxy without an answer
        servers += "\n    option allbackups\n" + "\n".join(
            f"    server router-{i}-spare 127.0.0.1:{p} backup"
            for i, p in enumerate(self.router_ports)
        )
        config = self.workdir / "haproxy.cfg"
        config.write_text(
            "global\n    maxconn 4096\n\n"
            "defaults\n    mode tcp\n    timeout connect 2s\n"
            "    timeout client 10m\n    timeout server 10m\n"
            # as deploy/haproxy.cfg: a connection a dead router refuses goes to another one
            "    retries 2\n    option redispatch\n\n"
            f"frontend kvrouter\n    bind 127.0.0.1:{self.haproxy_port}\n"
            "    default_backend routers\n\n"
            "backend routers\n    balance roundrobin\n"
            "    option httpchk GET /health\n"
            f"{servers}\n"
        )
        return [binary, "-db", "-f", str(config)]

    def _trackers(self, argv: list[str]) -> list[ProcessSpec]:
        lease = self.config.tracker_lease_s
        if lease > 0:
            argv = [*argv, "--lease-ttl-s", str(lease)]
        out = [ProcessSpec("tracker", argv, f"http://127.0.0.1:{self.tracker_port}/health")]
        if lease > 0:  # started once the first one is up: it stands by
            port = self.standby_tracker_port
            standby = [*argv, "--http-port", str(port)]
            out.append(ProcessSpec("standby-tracker", standby, f"http://127.0.0.1:{port}/health"))
        return out

    def _sentinels(self, binary: str) -> list[ProcessSpec]:
        assert self.redis_replica_port is not None
        replica_dir = self.workdir / "redis-replica"
        replica_dir.mkdir(exist_ok=True)
        replicaof = ("--replicaof", "127.0.0.1", str(self.redis_port))
        argv = redis_server_argv(self.redis_replica_port, replica_dir, *replicaof)
        out = [ProcessSpec("redis-replica", argv, port=self.redis_replica_port)]
        for i, port in enumerate(self.sentinel_ports):
            conf = sentinel_config(port, self.workdir, self.redis_port, down_after_ms=1000)
            out.append(ProcessSpec(f"sentinel-{i}", [binary, str(conf), "--sentinel"], port=port))
        return out

    def endpoints(self) -> list[tuple[str, str, str]]:
        """Per engine, in port order: HTTP URL, event (PUB) and replay endpoints to connect to."""
        return [
            (
                url,
                f"tcp://127.0.0.1:{self.events_port + i}",
                f"tcp://127.0.0.1:{self.replay_port + i}",
            )
            for i, url in enumerate(self.replica_urls)
        ]

    def describe(self) -> dict[str, Any]:
        """Where everything listens (for people: ``python -m bench.stack`` prints it)."""
        out: dict[str, Any] = {
            "entry": self.entry_url,
            "routers": self.router_urls,
            "replicas": self.replica_urls,
            "events": [
                f"tcp://127.0.0.1:{self.events_port + i}" for i in range(self.config.replicas)
            ],
            "replay": [
                f"tcp://127.0.0.1:{self.replay_port + i}" for i in range(self.config.replicas)
            ],
            "logs": str(self.workdir),
        }
        if self.redis_url is not None:
            out["redis"] = self.redis_url
            out["tracker"] = f"http://127.0.0.1:{self.tracker_port}"
        if self.config.gateway is not None:
            out["pickers"] = [f"127.0.0.1:{port}" for port in self.grpc_ports]
            out["envoy_admin"] = f"http://127.0.0.1:{self.envoy_admin_port}"
        return out
