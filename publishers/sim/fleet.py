"""The ``kvrouter replica`` process: simulated engines, their publishers and servers in one loop.

Engine ``i`` serves HTTP on ``port + i`` and publishes KV events on the event and replay ports
``+ i``, like a fleet of single-GPU vLLM servers. With a registry URL every engine is
registered (one ``instance`` per process start, so a restart fences the old blocks) and
heartbeated. Shutdown, on SIGINT/SIGTERM: deregister, drain the HTTP servers, stop the
engines, flush and close the publishers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import uuid
from dataclasses import dataclass

import zmq
from prometheus_client import CollectorRegistry

from publishers.config import WILDCARD_HOSTS, ReplicaSettings, shape_fields, tcp_parts
from publishers.registration import RegistrationService
from publishers.sim.engine import EngineConfig, SimulatedEngine
from publishers.sim.faults import debug_routes
from publishers.sim.server import create_app
from publishers.zmq import ZmqEventPublisher, binds
from tracker.core.backends import open_index
from tracker.core.chat import load_chat_template
from tracker.core.index import BlockIndex, ReplicaRecord
from tracker.core.tokens import Tokenizer
from tracker.framework.errors import ConfigError
from tracker.framework.http import HTTPServer, bind
from tracker.framework.lifecycle import run_on_loop

logger = logging.getLogger(__name__)


def load_tokenizer(settings: ReplicaSettings) -> Tokenizer:
    """The tokenizer every engine of the process shares (thread-safe)."""
    if settings.tokenizer is not None:
        return Tokenizer.from_files(settings.tokenizer, settings.chat_template)
    if settings.chat_template is not None:
        return Tokenizer.builtin(load_chat_template(settings.chat_template))
    return Tokenizer.builtin()


def _offset(endpoint: str, i: int) -> str:
    host, port = tcp_parts(endpoint, "endpoint")
    return f"tcp://{host}:{port + i}"


@dataclass
class _Replica:
    id: str
    engine: SimulatedEngine
    publisher: ZmqEventPublisher
    server: HTTPServer
    record: ReplicaRecord


class FleetService:
    """Owns ``settings.count`` simulated replicas; :meth:`start` / :meth:`stop`.

    :param tokenizer: shared by every engine; default :func:`load_tokenizer`.
    :param index: the registry; default a RedisIndex on ``settings.redis`` (if set).
    """

    def __init__(
        self,
        settings: ReplicaSettings,
        *,
        tokenizer: Tokenizer | None = None,
        index: BlockIndex | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer or load_tokenizer(settings)
        self.instance = uuid.uuid4().hex
        self.replicas: list[_Replica] = []
        self._index = index
        self._owns_index = False
        self._registration: RegistrationService | None = None

    @property
    def advertise_host(self) -> str:
        host = self.settings.advertise_host or self.settings.host
        return socket.gethostname() if host in WILDCARD_HOSTS else host

    async def start(self) -> None:
        """Start every replica, then register them; on failure, undo what was started."""
        try:
            for i in range(self.settings.count):
                self.replicas.append(await self._start_one(i))
            if self._index is None and self.settings.redis:
                self._index = open_index(self.settings.redis)
                self._owns_index = True
            if self._index is not None:
                self._registration = RegistrationService(
                    self._index,
                    [r.record for r in self.replicas],
                    interval_s=self.settings.heartbeat_s,
                )
                await self._registration.start()
        except BaseException:
            await self.stop()
            raise

    async def _start_one(self, i: int) -> _Replica:
        s = self.settings
        replica_id = f"{s.id_prefix}{i}"
        events = _offset(s.events, i)
        replay = _offset(s.replay, i) if s.replay else None
        try:
            config = EngineConfig(
                **shape_fields(s),
                model=s.model,
                hash_seed=s.hash_seed,
                max_model_len=s.max_model_len,
                lookahead_tokens=s.lookahead_tokens,
                offload_blocks=s.offload_blocks,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        bound = binds(events)  # vLLM's rule exactly: bind on a wildcard, else connect out
        try:
            publisher = ZmqEventPublisher(
                events,
                replay,
                topic=s.topic.encode(),
                era=s.wire_era,
                replay_layout=s.replay_framing,
                bind=bound,
            )
        except zmq.ZMQError as exc:
            raise ConfigError(f"{replica_id}: cannot open {events} / {replay}: {exc}") from None
        try:
            engine = SimulatedEngine(config, sink=publisher)
        except ValueError as exc:
            publisher.close()
            raise ConfigError(str(exc)) from None
        try:
            sock = bind(s.host, s.port + i)
        except ConfigError as exc:
            publisher.close()
            raise ConfigError(f"{replica_id}: {exc}") from None
        await engine.start()
        app = create_app(
            engine,
            self.tokenizer,
            model=s.model,
            registry=CollectorRegistry(),
            max_body_bytes=s.max_body_bytes,
            engine_id=replica_id,
            adapters=s.lora_modules,
        )
        app.router.routes.extend(debug_routes(engine, publisher, model=s.model, faults=s.faults))
        server = HTTPServer(app, sock, shutdown_timeout_s=s.shutdown_timeout_s)
        try:
            await server.start()
        except BaseException:
            await engine.stop()
            publisher.close()
            sock.close()
            raise
        host = self.advertise_host
        record = ReplicaRecord(
            id=replica_id,
            model=s.model,
            block_size=s.block_size,
            url=f"http://{host}:{s.port + i}",
            # a PUB that connects out (vLLM's rule for a named host) has nothing to connect to
            events=f"tcp://{host}:{tcp_parts(events, 'events')[1]}" if bound else None,
            replay=f"tcp://{host}:{tcp_parts(replay, 'replay')[1]}" if replay else None,
            instance=self.instance,
            ttl_s=s.ttl_s,
        )
        logger.info(
            "replica ready",
            extra={"replica": replica_id, "url": record.url, "events": events, "replay": replay},
        )
        return _Replica(replica_id, engine, publisher, server, record)

    async def stop(self) -> None:
        """Deregister, drain HTTP, stop engines, close publishers (each step bounded)."""
        if self._registration is not None:
            await self._registration.stop()
            self._registration = None
        await asyncio.gather(*(r.server.stop() for r in self.replicas))
        for replica in self.replicas:
            await replica.engine.stop()
        await asyncio.gather(*(asyncio.to_thread(r.publisher.close) for r in self.replicas))
        if self._owns_index and self._index is not None:
            await self._index.close()
            self._index = None
        if self.replicas:
            logger.info("replicas stopped", extra={"count": len(self.replicas)})
        self.replicas = []


def run(settings: ReplicaSettings) -> int:
    """``kvrouter replica``: serve until SIGINT/SIGTERM, then shut down gracefully."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        service = FleetService(settings)
        await service.start()
        try:
            await stop.wait()
        finally:
            await service.stop()

    run_on_loop(main(), settings.loop)
    return 0
