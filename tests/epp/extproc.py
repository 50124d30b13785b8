"""A gRPC client that speaks to ``kvrouter epp`` as Envoy's ext_proc filter does.

It sends the messages a gateway sends for one HTTP request (headers, body chunks, then the
response's) over a real gRPC stream and reads the picker's answers; the Envoy tests
(``test_envoy_epp.py``) check the same behaviour behind a real Envoy.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from google.protobuf import struct_pb2

Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
BUFFERED = Mode.BUFFERED


def headers(values: Mapping[str, str], *, end: bool = False) -> Any:
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        ),
        end_of_stream=end,
    )


def lb_metadata(namespace: str, key: str, value: str | Sequence[str]) -> Any:
    context = base_pb2.Metadata()
    entry = context.filter_metadata[namespace].fields[key]
    if isinstance(value, str):
        entry.string_value = value
    else:
        entry.list_value.values.extend(struct_pb2.Value(string_value=v) for v in value)
    return context


def request_headers(
    path: str = "/v1/chat/completions",
    *,
    mode: int = FULL_DUPLEX,
    response_mode: int = FULL_DUPLEX,
    end: bool = False,
    extra: Mapping[str, str] | None = None,
    subset: Sequence[str] | None = None,
) -> Any:
    values = {":method": "POST", ":path": path, ":authority": "gateway", **(extra or {})}
    message = pb.ProcessingRequest(
        request_headers=headers(values, end=end),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=mode, response_body_mode=response_mode
        ),
    )
    if subset is not None:
        message.metadata_context.CopyFrom(
            lb_metadata("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset)
        )
    return message


def request_body(data: bytes, *, end: bool) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def response_headers(status: int = 200, *, served: str | None = None, sse: bool = True) -> Any:
    kind = "text/event-stream" if sse else "application/json"
    message = pb.ProcessingRequest(
        response_headers=headers({":status": str(status), "content-type": kind})
    )
    if served is not None:
        message.metadata_context.CopyFrom(
            lb_metadata("envoy.lb", "x-gateway-destination-endpoint-served", served)
        )
    return message


def response_body(data: bytes, *, end: bool) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


def destination(answer: Any) -> str:
    """The ``x-gateway-destination-endpoint`` an answer sets (headers or buffered body)."""
    common = (
        answer.request_headers.response
        if answer.HasField("request_headers")
        else answer.request_body.response
    )
    found = [
        h.header.raw_value.decode()
        for h in common.header_mutation.set_headers
        if h.header.key == "x-gateway-destination-endpoint"
    ]
    assert len(found) == 1, answer
    assert common.clear_route_cache
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert metadata.fields["x-gateway-destination-endpoint"].string_value == found[0]
    return found[0]


def set_headers(answer: Any, kind: str) -> dict[str, str]:
    common = getattr(answer, kind).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def streamed(answers: Sequence[Any], kind: str = "request_body") -> tuple[bytes, bool]:
    """The body the answers stream back, and whether the last chunk ended it."""
    chunks = [getattr(a, kind).response.body_mutation.streamed_response for a in answers]
    return b"".join(c.body for c in chunks), bool(chunks) and chunks[-1].end_of_stream


def chat_body(**fields: Any) -> bytes:
    return msgspec.json.encode(fields)


class Stream:
    """One ext_proc stream (one HTTP request) to the picker."""

    def __init__(self, stub: Any) -> None:
        self.call = stub.Process()

    async def send(self, *messages: Any) -> None:
        for message in messages:
            await self.call.write(message)

    async def read(self, count: int) -> list[Any]:
        """The next ``count`` answers (within 10 s)."""
        out: list[Any] = []
        async with asyncio.timeout(10):
            for _ in range(count):
                answer = await self.call.read()
                assert answer is not grpc.aio.EOF, f"stream ended after {out}"
                out.append(answer)
        return out

    async def closed(self) -> bool:
        """Whether the picker ended the stream (nothing more to read)."""
        async with asyncio.timeout(10):
            return await self.call.read() is grpc.aio.EOF

    async def end(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> None:
        self.call.cancel()


class Gateway:
    """A channel to the picker's ext_proc port (TLS without verification when asked)."""

    def __init__(self, port: int, *, certificate: bytes | None = None) -> None:
        target = f"127.0.0.1:{port}"
        if certificate is None:
            self.channel = grpc.aio.insecure_channel(target)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=certificate)
            options = [("grpc.ssl_target_name_override", "localhost")]
            self.channel = grpc.aio.secure_channel(target, credentials, options)
        self.stub = external_processor_pb2_grpc.ExternalProcessorStub(self.channel)

    def stream(self) -> Stream:
        return Stream(self.stub)

    async def close(self) -> None:
        await self.channel.close()


def server_certificate(port: int) -> bytes:
    """The certificate a TLS server on ``port`` presents (PEM), unverified."""
    return ssl.get_server_certificate(("127.0.0.1", port)).encode()
