"""Envoy ext_proc messages in and out: headers and metadata read, answers built.

The gateway protocol (Gateway API Inference Extension, endpoint picker): once the request
body is whole, the picker answers with the request headers' mutation (the destination
``x-gateway-destination-endpoint: ip:port[,ip:port…]``, the route cache cleared) and the same
value in dynamic metadata under ``envoy.lb``, then the body itself in ``streamed_response``
chunks of at most :data:`MAX_CHUNK` bytes. An error is an ``ImmediateResponse`` with an
OpenAI-shaped body.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final, TypeAlias

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.errors import openai_error_body, status_of

DESTINATION: Final = "x-gateway-destination-endpoint"
SERVED: Final = "x-gateway-destination-endpoint-served"
SUBSET: Final = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
CONFORMANCE_HEADER: Final = "test-epp-endpoint-selection"
"""The header GIE's conformance suite restricts the pick with (comma-separated IPs)."""
EXT_PROC_ATTRIBUTES: Final = "envoy.filters.http.ext_proc"
UPSTREAM_ADDRESS: Final = "upstream.address"
MAX_CHUNK: Final = 62_000
"""Largest body chunk sent back: gRPC frames and Envoy's buffers stay small."""

_encode = msgspec.json.Encoder().encode
# Envoy's generated protos carry no type information: their messages are Any to mypy
ProcessingRequest: TypeAlias = ext_proc.ProcessingRequest
ProcessingResponse: TypeAlias = ext_proc.ProcessingResponse


def header_map(headers: ext_proc.HttpHeaders) -> dict[str, str]:
    """The headers of a message, keys in lower case (Envoy sends values as raw bytes)."""
    return {
        h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        for h in headers.headers.headers
    }


def _struct_value(struct: struct_pb2.Struct, key: str) -> Any:
    if key not in struct.fields:
        return None
    value = struct.fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    return None


def metadata(request: ProcessingRequest, namespace: str, key: str) -> Any:
    """A string (or list of strings) the gateway put in ``metadata_context`` under
    ``namespace`` / ``key``; None when absent."""
    if namespace not in request.metadata_context.filter_metadata:
        return None
    return _struct_value(request.metadata_context.filter_metadata[namespace], key)


def attribute(request: ProcessingRequest, name: str) -> str | None:
    """An Envoy attribute the filter was asked to send (e.g. ``upstream.address``)."""
    if EXT_PROC_ATTRIBUTES not in request.attributes:
        return None
    value = _struct_value(request.attributes[EXT_PROC_ATTRIBUTES], name)
    return value if isinstance(value, str) and value else None


def _set(headers: Mapping[str, str]) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in headers.items()
        ]
    )


def destination_metadata(destination: str) -> struct_pb2.Struct:
    """``{"envoy.lb": {"x-gateway-destination-endpoint": destination}}``."""
    metadata = struct_pb2.Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = destination
    return metadata


def routed(destination: str, headers: Mapping[str, str], *, buffered: bool) -> ProcessingResponse:
    """The pick: the request headers' mutation, the route cache cleared, the metadata.

    :param buffered: the body was buffered by the gateway (``BUFFERED`` mode): the mutation
        rides on the body's answer, the headers having been answered already.
    """
    common = ext_proc.CommonResponse(
        header_mutation=_set({DESTINATION: destination, **headers}), clear_route_cache=True
    )
    metadata = destination_metadata(destination)
    if buffered:
        return ProcessingResponse(
            request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=metadata
        )
    return ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=metadata
    )


def body_chunks(body: bytes, *, request: bool, end_of_stream: bool) -> Iterator[ProcessingResponse]:
    """``body`` sent back as ``streamed_response`` chunks of at most :data:`MAX_CHUNK`
    bytes, the last one carrying ``end_of_stream`` (at least one, even for an empty body)."""
    view = memoryview(body)
    starts = range(0, max(len(body), 1), MAX_CHUNK)
    for start in starts:
        last = start + MAX_CHUNK >= len(body)
        mutation = ext_proc.BodyMutation(
            streamed_response=ext_proc.StreamedBodyResponse(
                body=bytes(view[start : start + MAX_CHUNK]), end_of_stream=end_of_stream and last
            )
        )
        answer = ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))
        yield (
            ProcessingResponse(request_body=answer)
            if request
            else ProcessingResponse(response_body=answer)
        )


def proceed(kind: str, headers: Mapping[str, str] | None = None) -> ProcessingResponse:
    """Let a message through unchanged (``kind``: ``request_headers``, ``request_body``,
    ``response_headers``, …), optionally setting ``headers``."""
    if kind.endswith("trailers"):
        return ProcessingResponse(**{kind: ext_proc.TrailersResponse()})
    common = ext_proc.CommonResponse(header_mutation=_set(headers)) if headers else None
    answer = (
        ext_proc.HeadersResponse(response=common)
        if kind.endswith("headers")
        else ext_proc.BodyResponse(response=common)
    )
    return ProcessingResponse(**{kind: answer})


def refusal(error: BaseException) -> ProcessingResponse:
    """The request answered by the gateway itself: the error's status and OpenAI body."""
    return ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status_of(error)),
            headers=_set({"content-type": "application/json"}),
            body=_encode(openai_error_body(error)),
            details=type(error).__name__,
        )
    )
