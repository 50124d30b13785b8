"""Simulation-only routes of a simulated engine, not part of vLLM: its prefix cache as
kvrouter block keys (``GET /kvrouter/cached_blocks``), and event loss injected between it and
the tracker (``POST /kvrouter/faults``), for the consistency checks and the fault drills.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from publishers.sim.cache import CachedBlock
from publishers.sim.engine import SimulatedEngine
from publishers.zmq import ZmqEventPublisher
from tracker.core.blocks import Namespace, block_keys, own_extra_keys


class FaultRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /kvrouter/faults``: how many upcoming event batches to drop or lose.

    ``drop_events`` batches go to the replay buffer only (a gap that replay repairs);
    ``lose_events`` go nowhere and empty the replay buffer (a gap beyond it, which the tracker
    can only answer by clearing the replica). An engine that stalls or dies is simulated with
    signals (SIGSTOP, SIGKILL), not here.
    """

    drop_events: int = 0
    lose_events: int = 0


def index_keys(blocks: dict[int, CachedBlock], model: str, block_size: int) -> set[int]:
    """kvrouter keys of every cached block (each chained from its parents' keys).

    A block whose ancestor left the cache first has no computable key here and is left out
    (the engine frees leaves before parents, so this does not happen in practice).
    """
    keys: dict[int, int | None] = {}
    for engine_hash in blocks:
        chain = [engine_hash]  # walk up iteratively: chains are as long as the prompts
        while chain[-1] not in keys:
            parent = blocks[chain[-1]].parent_hash
            if parent is None:
                break
            if parent not in blocks:
                keys[parent] = None
            chain.append(parent)
        for current in reversed(chain):
            if current in keys:
                continue
            block = blocks[current]
            parent = block.parent_hash
            parent_key = None if parent is None else keys[parent]
            if parent is not None and parent_key is None:
                keys[current] = None
                continue
            extra = own_extra_keys(
                block.lora_name, None if block.extra_keys is None else [block.extra_keys]
            )
            keys[current] = block_keys(
                [*block.token_ids, *block.lookahead_token_ids],
                Namespace(model, block_size, block.lora_name),
                parent=parent_key,
                extra_keys=extra,
                lookahead=len(block.lookahead_token_ids),
            )[0]
    return {key for h, key in keys.items() if key is not None and h in blocks}


def debug_routes(
    engine: SimulatedEngine, publisher: ZmqEventPublisher, *, model: str, faults: bool
) -> list[Route]:
    """The simulation-only routes of one engine.

    ``GET /kvrouter/cached_blocks`` answers what a consistent index holds for the engine: the
    kvrouter block key of every block in its prefix cache, and the sequence number of the last
    event batch it published (``-1``: none yet). ``POST /kvrouter/faults`` (:class:`FaultRequest`)
    is left out unless ``faults`` (``kvrouter replica --faults``).
    """
    config = engine.config

    async def cached_blocks(request: Request) -> Response:
        keys = index_keys(engine.cached_blocks(), model, config.block_size)
        body: dict[str, Any] = {
            "model": model,
            "block_size": config.block_size,
            "last_seq": publisher.published - 1,  # sent or still queued
            "idle": engine.idle,
            "keys": sorted(keys),
        }
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def inject(request: Request) -> Response:
        try:
            fault = msgspec.json.decode(await request.body(), type=FaultRequest)
        except msgspec.ValidationError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "BadRequestError"}}, 400)
        except msgspec.DecodeError:
            return JSONResponse(
                {"error": {"message": "invalid JSON", "type": "BadRequestError"}}, 400
            )
        if fault.drop_events < 0 or fault.lose_events < 0:
            message = "event counts must be >= 0"
            return JSONResponse({"error": {"message": message, "type": "BadRequestError"}}, 400)
        publisher.drop_live(fault.drop_events)
        publisher.lose(fault.lose_events)
        return JSONResponse({"drop_events": fault.drop_events, "lose_events": fault.lose_events})

    routes = [Route("/kvrouter/cached_blocks", cached_blocks)]
    if faults:
        routes.append(Route("/kvrouter/faults", inject, methods=["POST"]))
    return routes
