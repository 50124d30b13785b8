"""EppService: one endpoint-picker process — the router's parts behind ext_proc gRPC.

Three ports: ext_proc (``--grpc-port``, TLS unless ``--no-secure-serving``, also answering
``grpc.health.v1``), gRPC health (``--health-port``, plaintext as the kubelet's gRPC probes
need: ``liveness``, ``readiness`` and the ext_proc service), and HTTP
(``--port``: ``/metrics``, ``/health``, ``/index``, ``/replicas``). Every replica is active:
they share the index and the load through Redis. Shutdown: health says NOT_SERVING, new
streams are refused, streams in flight get ``shutdown_timeout_s`` to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Final

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from router.backing import Backing
from router.config import EppSettings
from router.decide.tokenize import TokenizerBook
from router.epp.picker import EndpointPicker
from router.epp.processor import Processor
from router.epp.tls import server_credentials
from router.http.app import Routes, operator_app
from router.http.auth import KeyCheck, load_keys
from router.router import Router
from router.shared.redis_load import new_router_id
from tracker.framework.errors import ConfigError
from tracker.framework.http import HTTPServer, bind
from tracker.framework.lifecycle import run_on_loop, run_until_signalled, serve_until

logger = logging.getLogger(__name__)

EXT_PROC_SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES: Final = ("", "liveness", "readiness", EXT_PROC_SERVICE)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EppService:
    """One endpoint picker: :meth:`start`, :meth:`run` until :meth:`request_stop`, :meth:`stop`.

    :param registry: where every metric goes (default: a fresh one).
    """

    def __init__(self, settings: EppSettings, *, registry: CollectorRegistry | None = None) -> None:
        self.router_id = settings.router_id or new_router_id()
        self.settings = dataclasses.replace(settings, router_id=self.router_id)
        self.registry = registry or CollectorRegistry()
        self.backing = Backing()
        self.router: Router | None = None
        self.processor: Processor | None = None
        self.health = health.aio.HealthServicer()
        self.grpc_port: int | None = None
        self.health_port: int | None = None
        self.port: int | None = None
        self._servers: list[grpc.aio.Server] = []
        self._http: HTTPServer | None = None
        self._stopping = asyncio.Event()
        self._stopped = False

    async def start(self) -> None:
        """Open the index, start the router's parts, serve; undo everything on failure."""
        settings = self.settings
        try:
            index = await self.backing.open(settings, self.registry)
            tokenizers = await asyncio.to_thread(TokenizerBook.load, settings)
            self.router = router = Router(
                settings,
                index=index,
                registry=self.registry,
                redis=self.backing.client,
                tokenizers=tokenizers,
            )
            await router.start()
            picker = EndpointPicker(
                settings, decider=router.decider, replicas=router.replicas, metrics=router.metrics
            )
            keys = KeyCheck(load_keys(settings.api_key, settings.api_key_file, "api-key"))
            self.processor = processor = Processor(
                picker, router.metrics, max_body_bytes=settings.max_body_bytes, keys=keys
            )
            await self._serve_grpc(processor)
            routes = Routes(router, inflight=lambda: processor.streams)
            self._http = HTTPServer(
                operator_app(routes),
                bind(settings.host, settings.port),
                shutdown_timeout_s=settings.shutdown_timeout_s,
                name="the endpoint picker's HTTP",
            )
            self.port = self._http.port
            await self._http.start()
            for service in HEALTH_SERVICES:
                await self.health.set(service, _SERVING)
        except BaseException:
            await self._close()
            raise
        logger.info(
            "endpoint picker listening",
            extra={
                "host": settings.host,
                "grpc_port": self.grpc_port,
                "health_port": self.health_port,
                "http_port": self.port,
                "tls": settings.secure_serving,
                "router_id": self.router_id,
            },
        )

    async def _serve_grpc(self, processor: Processor) -> None:
        settings = self.settings
        credentials = server_credentials(settings)
        limit = settings.max_body_bytes + (1 << 20)  # a BUFFERED body arrives in one message
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
        ext_proc = grpc.aio.server(options=options, maximum_concurrent_rpcs=settings.max_streams)
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(processor, ext_proc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, ext_proc)
        probes = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, probes)
        self._servers = [ext_proc, probes]
        ports = []
        for server, port, tls in (
            (ext_proc, settings.grpc_port, credentials),
            (probes, settings.health_port, None),  # the kubelet's gRPC probes speak no TLS
        ):
            address = _address(settings.host, port)
            try:
                bound = (
                    server.add_insecure_port(address)
                    if tls is None
                    else server.add_secure_port(address, tls)
                )
            except RuntimeError:  # grpc's "Failed to bind" (in use, not local, bad name)
                bound = 0
            if not bound:
                raise ConfigError(f"cannot listen on {address} (in use, or not an address here)")
            ports.append(bound)
            await server.start()
        self.grpc_port, self.health_port = ports

    def request_stop(self) -> None:
        """Begin the graceful shutdown (safe from a signal handler)."""
        if not self._stopping.is_set():
            logger.info("endpoint picker stop requested")
        self._stopping.set()

    async def run(self) -> int:
        """Serve until :meth:`request_stop`, then shut down; returns an exit status."""
        if not self._servers:
            await self.start()
        assert self._http is not None
        failed = await serve_until(self._stopping, self._http.task)
        await self.stop()
        return 1 if failed else 0

    async def stop(self) -> None:
        """Say NOT_SERVING, let streams in flight end (bounded), close everything."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        streams = self.processor.streams if self.processor is not None else 0
        logger.info("endpoint picker draining", extra={"streams": streams})
        await self.health.enter_graceful_shutdown()
        await self._close()
        left = self.processor.streams if self.processor is not None else 0
        logger.info("endpoint picker stopped", extra={"drained": streams - left, "cut": left})

    async def _close(self) -> None:
        # the ext_proc streams drain first, the probes seeing NOT_SERVING until they are done;
        # then the health server stops at once (a Watch of it would hold any grace to its end)
        grace = self.settings.shutdown_timeout_s
        for server, seconds in zip(self._servers, (grace, 0.0), strict=False):
            await server.stop(seconds)
        self._servers = []
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self.router is not None:
            await self.router.stop()
            self.router = None
        await self.backing.close()


async def serve(settings: EppSettings) -> int:
    """Run an endpoint picker until SIGINT/SIGTERM."""
    return await run_until_signalled(EppService(settings))


def run(settings: EppSettings) -> int:
    """One endpoint picker in this process until SIGINT/SIGTERM; returns the exit status."""
    return run_on_loop(serve(settings), settings.loop)
