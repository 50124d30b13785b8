"""One HTTP request through the gateway: its ext_proc messages in, the answers out.

The request side waits for the whole body (``FULL_DUPLEX_STREAMED``: its chunks arrive
first and are echoed after the pick; ``BUFFERED``: the gateway sends it in one message and
takes the pick on the body's answer), places it, and answers in order: headers, body,
trailers. The response side names the endpoint that served (after the gateway's retries),
sees the first token in the first body chunk, reads the engine's usage, and echoes every
chunk. However the stream ends, the attempt is finished once.
"""

from __future__ import annotations

import logging
from typing import Final

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from router.decide.request import answer_cached_tokens
from router.epp import messages
from router.epp.messages import ProcessingRequest, ProcessingResponse
from router.epp.picker import EndpointPicker, Pick
from router.errors import AuthError, PayloadTooLargeError, RouterError
from router.http.auth import KeyCheck
from router.http.sse import UsageFilter
from tracker.framework.http import body_limit_message

logger = logging.getLogger(__name__)

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX: Final = _Mode.FULL_DUPLEX_STREAMED
BUFFERED: Final = (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL)
JSON_USAGE_LIMIT: Final = 4 << 20
"""An answer that is not streamed is read for its usage up to this many bytes."""


class Exchange:
    """The state of one ext_proc stream (one HTTP request and its response).

    :param max_body_bytes: a larger request body is answered 413 by the gateway.
    :param keys: the API keys a request must carry (none: the gateway's business).
    """

    def __init__(self, picker: EndpointPicker, *, max_body_bytes: int, keys: KeyCheck) -> None:
        self.picker = picker
        self.max_body_bytes = max_body_bytes
        self.keys = keys
        self.request_mode: int = FULL_DUPLEX
        self.response_mode: int | None = None  # not said: the gateway's choice is unknown
        self.path = ""
        self.allowed: list[str] | None = None
        self.session: str | None = None
        self.body = bytearray()
        self.pick: Pick | None = None
        self.refused = False
        self.status = 0
        self.response_started = False
        self.response_chunks = 0
        self.response_ended = False
        self._usage: UsageFilter | None = None
        self._answer: bytearray | None = None

    # ------------------------------------------------------------------ request side

    async def receive(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        """The answers to one message from the gateway (maybe none yet)."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(message)
            if kind == "request_body":
                return await self._request_body(message)
            if kind == "request_trailers":
                return await self._request_trailers()
            if kind == "response_headers":
                return self._response_headers(message)
            if kind == "response_body":
                return self._response_body(message)
            if kind == "response_trailers":
                self._ended()
                return [messages.proceed("response_trailers")]
        except RouterError as exc:
            return [self._refuse(exc)]
        except Exception as exc:
            logger.exception("endpoint picker failed on a request", extra={"path": self.path})
            return [self._refuse(exc)]
        return []

    async def _request_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.request_mode = config.request_body_mode
            self.response_mode = config.response_body_mode
        headers = messages.header_map(message.request_headers)
        self.path = headers.get(":path", "")
        if not self.keys.allows_header(headers.get("authorization", "")):
            raise AuthError("Incorrect API key provided.")
        self.allowed = self._allowed(message, headers)
        self.session = self.picker.session_of(headers)
        if message.request_headers.end_of_stream:  # no body: e.g. GET /v1/models
            return [await self._route(None, buffered=False)]
        if self.request_mode in BUFFERED:
            return [messages.proceed("request_headers")]
        if self.request_mode == _Mode.NONE:  # the body will not be shown: placed on load
            return [await self._route(None, buffered=False)]
        if self.request_mode != FULL_DUPLEX:
            raise RouterError(
                "the gateway's ext_proc request body mode is not supported: configure "
                "FULL_DUPLEX_STREAMED (or BUFFERED)"
            )
        return []

    @staticmethod
    def _allowed(message: ProcessingRequest, headers: dict[str, str]) -> list[str] | None:
        """The endpoints the gateway allows (its subset hint), or the conformance suite's
        ``test-epp-endpoint-selection``; None: any."""
        hint = messages.metadata(message, messages.SUBSET_NAMESPACE, messages.SUBSET)
        if isinstance(hint, str):
            hint = hint.split(",")
        if hint is not None:
            return list(hint)
        selection = headers.get(messages.CONFORMANCE_HEADER)
        return selection.split(",") if selection is not None else None

    async def _request_body(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        chunk = message.request_body
        self.body += chunk.body
        if len(self.body) > self.max_body_bytes:
            raise PayloadTooLargeError(body_limit_message(self.max_body_bytes))
        if not chunk.end_of_stream:
            return []
        if self.request_mode in BUFFERED:
            return [await self._route(bytes(self.body), buffered=True)]
        answers = [await self._route(bytes(self.body), buffered=False)]
        answers += messages.body_chunks(bytes(self.body), request=True, end_of_stream=True)
        return answers

    async def _request_trailers(self) -> list[ProcessingResponse]:
        trailers = messages.proceed("request_trailers")
        if self.pick is not None or self.request_mode != FULL_DUPLEX:
            return [trailers]
        # the body ended with the trailers: pick now, then body and trailers in order
        answers = [await self._route(bytes(self.body), buffered=False)]
        answers += messages.body_chunks(bytes(self.body), request=True, end_of_stream=False)
        return [*answers, trailers]

    async def _route(self, body: bytes | None, *, buffered: bool) -> ProcessingResponse:
        self.pick = await self.picker.pick(
            self.path if body is not None else "",
            body or b"",
            self.allowed,
            session=self.session,
            sees_first_token=self.response_mode != _Mode.NONE,
        )
        return messages.routed(self.pick.destination, {}, buffered=buffered)

    def _refuse(self, error: BaseException) -> ProcessingResponse:
        self.refused = True
        self.picker.refused(self.path, error)
        if self.pick is not None:  # booked, then refused (e.g. a response we cannot read)
            self.picker.finish(self.pick, "error", self.status or 500, None)
        return messages.refusal(error)

    # ------------------------------------------------------------------ response side

    def _response_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        headers = messages.header_map(message.response_headers)
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.response_started = True
        receipt: dict[str, str] = {}
        if self.pick is not None:
            served = messages.metadata(message, messages.LB_NAMESPACE, messages.SERVED)
            address = served if isinstance(served, str) and served else None
            address = address or messages.attribute(message, messages.UPSTREAM_ADDRESS)
            self.picker.served(self.pick, address, self.status)
            receipt = self.pick.receipt()
            if "text/event-stream" in headers.get("content-type", ""):
                self._usage = UsageFilter(strip_usage=False)
            elif self.status == 200:
                self._answer = bytearray()
        if message.response_headers.end_of_stream:
            self._ended()
        return [messages.proceed("response_headers", receipt)]

    def _response_body(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        chunk = message.response_body
        self.response_chunks += 1
        if self.pick is not None:
            if self.response_chunks == 1 and self.status < 300:
                self.picker.first_token(self.pick)
            if self._usage is not None:
                self._usage.feed(chunk.body)
            elif self._answer is not None:
                if len(self._answer) + len(chunk.body) <= JSON_USAGE_LIMIT:
                    self._answer += chunk.body
                else:
                    self._answer = None
        if chunk.end_of_stream:
            self._ended()
        if self.response_mode == FULL_DUPLEX:
            return list(
                messages.body_chunks(chunk.body, request=False, end_of_stream=chunk.end_of_stream)
            )
        return [messages.proceed("response_body")]

    def _cached_tokens(self) -> int | None:
        if self._usage is not None:
            return self._usage.cached_tokens
        return answer_cached_tokens(self._answer) if self._answer else None

    def _ended(self) -> None:
        """The response is complete."""
        self.response_ended = True
        if self.pick is not None:
            outcome = "ok" if self.status < 500 else "error"
            self.picker.finish(self.pick, outcome, self.status, self._cached_tokens())

    def close(self) -> None:
        """The stream is over, however it ended (the gateway closed or reset it, the client
        left, the upstream broke): whatever the pick booked is finished."""
        if self.pick is None or self.pick.done:
            return
        # the body is not shown (Envoy closes the stream once the response headers are
        # answered): how the response ends is not seen
        unseen = self.response_started and self.response_chunks == 0
        if unseen and self.response_mode in (None, _Mode.NONE):
            outcome = "ok" if self.status < 500 else "error"
            self.picker.finish(self.pick, outcome, self.status, None, unseen=True)
        else:
            self.picker.finish(self.pick, "client_disconnect", self.status or 499, None)
