"""One simulated engine as a Dynamo worker: the ``dynamo`` arm's adapter process.

Runs in Dynamo's own virtualenv (``scripts/install-dynamo``), one process per engine, and
imports nothing of kvrouter's (that venv does not have it). It registers the engine with
Dynamo's discovery as a token-in worker of the bench's model and block size, relays the
engine's vLLM ZMQ KV events through Dynamo's own ``KvEventPublisher`` (which connects to the
engine's bound PUB socket), and serves Dynamo's ``generate`` endpoint by forwarding the token
ids to the engine's ``/v1/completions``: the engine's text comes back as token ids (the
engine streams text; the model directory's tokenizer encodes it back, which round-trips the
text exactly), and the engine's usage, cached prompt tokens included, rides on the last chunk.

    python bench/dynamo/adapter.py --engine http://127.0.0.1:8000 \
        --events tcp://127.0.0.1:5557 --model default --model-dir DIR --block-size 16

Environment: ``DYN_FILE_KV`` names the discovery directory its frontends share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

# Dynamo's bindings exist only in its own virtualenv (scripts/install-dynamo)
from dynamo.llm import (  # type: ignore[import-not-found,unused-ignore]
    KvEventPublisher,
    ModelInput,
    ModelRuntimeConfig,
    ModelType,
    WorkerType,
    register_model,
)
from dynamo.runtime import DistributedRuntime  # type: ignore[import-not-found,unused-ignore]
from tokenizers import Tokenizer

logger = logging.getLogger("kvrouter.bench.dynamo.adapter")

NAMESPACE: Final = "kvbench"
COMPONENT: Final = "engine"
ENDPOINT: Final = "generate"
_DATA: Final = b"data: "
_DONE: Final = b"[DONE]"


class EngineError(RuntimeError):
    """The engine refused a request or broke its stream; Dynamo reports it to the client."""


@dataclass(frozen=True, slots=True)
class AdapterSettings:
    """One adapter's engine and how Dynamo should see it.

    :param engine: the engine's base HTTP URL.
    :param events: the engine's KV event PUB endpoint (bound by the engine; connected here).
    :param model_dir: tokenizer and config files the frontend reads too.
    """

    engine: str
    events: str
    model: str
    model_dir: Path
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    context_length: int
    namespace: str = NAMESPACE


class EngineRelay:
    """Dynamo's ``generate`` over one engine's streaming ``/v1/completions``."""

    def __init__(self, session: aiohttp.ClientSession, settings: AdapterSettings) -> None:
        self._session = session
        self._url = f"{settings.engine.rstrip('/')}/v1/completions"
        self._model = settings.model
        self._tokenizer = Tokenizer.from_file(str(settings.model_dir / "tokenizer.json"))

    def body(self, request: dict[str, Any]) -> dict[str, Any]:
        """The engine request for Dynamo's preprocessed ``request`` (token ids in)."""
        stop = request.get("stop_conditions") or {}
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": list(request["token_ids"]),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if stop.get("max_tokens") is not None:
            body["max_tokens"] = int(stop["max_tokens"])
        return body

    async def generate(
        self, request: dict[str, Any], context: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Dynamo's handler: ``{"token_ids", "index"}`` chunks as the engine streams them;
        the last, with the finish reason, held for the engine's usage (which the engine
        sends after it, and Dynamo stops reading at a finish reason)."""
        last: dict[str, Any] | None = None
        async with self._session.post(self._url, json=self.body(request)) as response:
            if response.status != 200:
                text = await response.text(errors="replace")
                raise EngineError(f"engine answered HTTP {response.status}: {text[:300]}")
            async for event in _sse(response.content):
                if "error" in event:
                    raise EngineError(f"engine stream failed: {event['error']}")
                for choice in event.get("choices") or ():
                    chunk = self._chunk(choice)
                    if "finish_reason" in chunk:
                        last = chunk
                    else:
                        yield chunk
                if event.get("usage"):
                    last = last or {"token_ids": [], "index": 0}
                    last["completion_usage"] = event["usage"]
        if last is not None:
            last.setdefault("finish_reason", "length")
            yield last

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        text = choice.get("text") or ""
        chunk: dict[str, Any] = {
            "token_ids": self._tokenizer.encode(text, add_special_tokens=False).ids,
            "index": 0,
        }
        if choice.get("finish_reason"):
            chunk["finish_reason"] = choice["finish_reason"]
        return chunk


async def _sse(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream, up to ``[DONE]``."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(_DATA):
            continue
        payload = line[len(_DATA) :]
        if payload == _DONE:
            return
        yield json.loads(payload)


def runtime_config(settings: AdapterSettings) -> Any:
    """The engine's shape as Dynamo's router reads it at registration."""
    config = ModelRuntimeConfig()
    config.context_length = settings.context_length
    config.total_kv_blocks = settings.num_blocks
    config.max_num_seqs = settings.max_num_seqs
    config.max_num_batched_tokens = settings.max_num_batched_tokens
    config.enable_local_indexer = True
    config.kv_event_publishing_enabled = True
    return config


async def serve(settings: AdapterSettings) -> None:
    """Register, relay and serve until SIGTERM or SIGINT; then leave discovery first."""
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint(f"{settings.namespace}.{COMPONENT}.{ENDPOINT}")
    # subscribed before the engine is sent anything: Dynamo drops a stored block whose parent
    # it never saw, so the relay must see every event from the first
    publisher = KvEventPublisher(
        endpoint=endpoint,
        kv_block_size=settings.block_size,
        zmq_endpoint=settings.events,
        zmq_topic="",
        enable_local_indexer=True,
    )
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        connector=aiohttp.TCPConnector(limit=0),
    ) as session:
        relay = EngineRelay(session, settings)
        await register_model(
            ModelInput.Tokens,
            ModelType.Chat | ModelType.Completions,
            endpoint,
            str(settings.model_dir),
            settings.model,
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=settings.block_size,
            runtime_config=runtime_config(settings),
        )
        serving = asyncio.ensure_future(endpoint.serve_endpoint(relay.generate))
        logger.info("serving %s for %s (events %s)", ENDPOINT, settings.engine, settings.events)
        stopper = asyncio.create_task(stopping.wait())
        done, _ = await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if serving in done:
            serving.result()  # it ended on its own: say why
        logger.info("stopping: leaving discovery")
        await endpoint.unregister_endpoint_instance()
        runtime.shutdown()
        await asyncio.wait({serving}, timeout=5.0)
    del publisher  # kept alive until here: it relays from a thread of its own


def parse(argv: Sequence[str] | None = None) -> AdapterSettings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, help="the engine's base URL")
    parser.add_argument("--events", required=True, help="the engine's KV event PUB endpoint")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--model-dir", required=True, type=Path, help="tokenizer + config")
    parser.add_argument("--block-size", required=True, type=int)
    parser.add_argument("--num-blocks", required=True, type=int)
    parser.add_argument("--max-num-seqs", required=True, type=int)
    parser.add_argument("--max-num-batched-tokens", required=True, type=int)
    parser.add_argument("--context-length", required=True, type=int)
    parser.add_argument("--namespace", default=NAMESPACE)
    args = parser.parse_args(argv)
    return AdapterSettings(**{k.replace("-", "_"): v for k, v in vars(args).items()})


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(parse(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
