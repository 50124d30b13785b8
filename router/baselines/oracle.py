"""The benchmark's upper bound, not deployable: ``oracle``.

It probes every candidate's simulated engine (``POST /kvrouter/probe``, :mod:`publishers.sim.probe`)
for its own TTFT prediction from its real cache and queue, and picks the lowest. A candidate
whose probe fails is left out; with none answering (a real vLLM has no probe) it is this
router's least-load, with a probe round trip added to every decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final

import msgspec

from router.baselines.baseline import Baseline, Choice, baseline_score, best
from router.decide.policy_types import Decision
from router.errors import UpstreamError
from router.fleet.replicas import Replica
from tracker.framework.errors import TokenizationError

logger = logging.getLogger(__name__)

PROBE_PATH: Final = "/kvrouter/probe"
ORACLE_TIMEOUT_S: Final = 10.0
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class Oracle(Baseline):
    """The lowest TTFT the engines predict for the prompt (:data:`PROBE_PATH`)."""

    name = "oracle"

    async def choose(self, choice: Choice, stages: dict[str, float]) -> tuple[Decision, int]:
        started = time.perf_counter()
        try:
            ids = await self.tools.token_ids(choice.request, choice.model)
        except TokenizationError:
            ids = []
        tokenized = time.perf_counter()
        stages["tokenize"] = tokenized - started
        body = _encode({"token_ids": ids, "cache_salt": choice.request.cache_salt})
        answers = await asyncio.gather(*(self._probe(r, body) for r in choice.candidates))
        stages["probe"] = time.perf_counter() - tokenized
        scores = [
            baseline_score(
                r.id,
                -float(a["expected_ttft_ms"]),
                cached=int(a["expected_cached_tokens"]),
                ttft_ms=float(a["expected_ttft_ms"]),
            )
            for r, a in zip(choice.candidates, answers, strict=True)
            if a is not None
        ]
        if not scores or not ids:  # nothing to probe or no answer: least load
            inflight = self._local(choice)
            scores = [baseline_score(r, -float(n)) for r, n in inflight.items()]
            return best(scores, self.rng, self.name), len(ids)
        return best(scores, self.rng, self.name, tie=self.settings.tie_epsilon_ms), len(ids)

    async def _probe(self, replica: Replica, body: bytes) -> dict[str, Any] | None:
        """The engine's answer to the probe, or None (the failure logged as a warning)."""
        headers = {"content-type": "application/json"}
        try:
            async with asyncio.timeout(ORACLE_TIMEOUT_S):
                response = await self.tools.upstream.open(
                    replica.id,
                    replica.url,
                    PROBE_PATH,
                    body,
                    headers,
                    timeout_s=ORACLE_TIMEOUT_S,
                )
                try:
                    data = await response.read(ORACLE_TIMEOUT_S)
                finally:
                    await response.aclose()
        except (UpstreamError, TimeoutError) as exc:
            logger.warning("oracle probe failed", extra={"replica": replica.id, "error": str(exc)})
            return None
        try:
            answer = _decode(data) if response.status == 200 else None
        except msgspec.DecodeError:
            answer = None
        return answer if isinstance(answer, dict) and "expected_ttft_ms" in answer else None
