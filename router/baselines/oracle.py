"""The benchmark's upper bound, not deployable: ``oracle``.

It needs the simulated engine's probe: ``POST /kvrouter/probe`` with the prompt's token ids
(and cache salt) answers the engine's own TTFT prediction from its real prefix cache and
queue at that moment (:mod:`publishers.sim.probe`; no real engine can answer this cheaply, and
vLLM has no such endpoint). The oracle tokenizes the prompt, probes every candidate at once,
and picks the lowest ``expected_ttft_ms`` (ties within ``tie_epsilon_ms`` at random).

Without the probe it degrades to least-load, with nothing in the decision to say so: a
candidate whose probe fails (no answer within 10 s, a broken connection: logged as a
warning) or answers anything but a 200 with ``expected_ttft_ms`` (vLLM's 404: not logged) is
left out; when none answers, or the prompt cannot be tokenized, the candidate with the fewest
of this router's own requests in flight wins, ties at random. Against real engines the
oracle is therefore this router's least-load with a probe round trip added to every
decision.
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
