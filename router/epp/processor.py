"""The ext_proc service: one bidirectional stream per HTTP request through the gateway."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from router.epp.exchange import Exchange
from router.epp.messages import ProcessingRequest, ProcessingResponse
from router.epp.picker import EndpointPicker
from router.http.auth import KeyCheck
from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)


class Processor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``envoy.service.ext_proc.v3.ExternalProcessor``: each stream an :class:`Exchange`.

    :param max_body_bytes: / :param keys: see :class:`~router.epp.exchange.Exchange`.
    """

    def __init__(
        self,
        picker: EndpointPicker,
        metrics: RouterMetrics,
        *,
        max_body_bytes: int,
        keys: KeyCheck,
    ) -> None:
        self.picker = picker
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.keys = keys
        self.streams = 0

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        exchange = Exchange(self.picker, max_body_bytes=self.max_body_bytes, keys=self.keys)
        self.streams += 1
        self.metrics.epp_streams.inc()
        try:
            async for message in request_iterator:
                for answer in await exchange.receive(message):
                    yield answer
                if exchange.refused:
                    return  # the gateway answers the client itself; nothing more to process
        finally:
            self.streams -= 1
            self.metrics.epp_streams.dec()
            exchange.close()
