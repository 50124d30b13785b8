"""Picks for a gateway: the decision core's placement as a list of engine addresses.

Per request: the body is parsed and placed exactly as the HTTP proxy does
(:meth:`~router.decide.decider.Decider.place`), among the endpoints the gateway allows; the
pick is committed at once (its load lease, prediction and home claim), and the addresses
go back best first. When the gateway reports that another endpoint served the request (its
retries), the attempt moves there; when the response ends, however it ends, it is finished.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from router.config import RouterSettings
from router.decide.attempt import Attempt
from router.decide.decider import Decider
from router.decide.placement import Placement
from router.decide.request import Endpoint, parse
from router.epp.endpoints import Endpoints
from router.errors import NoReplicaError, status_of
from router.fleet.replicas import Replica, ReplicaSet
from router.http.body import PATHS
from router.http.proxy import DECISION_HEADER, FALLBACK_HEADER, PREDICTED_HEADER, REPLICA_HEADER
from router.metrics import RouterMetrics

ROUTES: dict[str, Endpoint] = {path: endpoint for endpoint, path in PATHS.items()}


def route_of(path: str) -> Endpoint | None:
    """The generation route a request path is (query and trailing slash ignored), if any."""
    return ROUTES.get(path.partition("?")[0].rstrip("/") or "/")


@dataclass(slots=True, eq=False)
class Pick:
    """Where one request through the gateway goes, and what was booked for it.

    :param endpoint: ``chat`` or ``completions``; None for another path (placed on load).
    :param destination: the addresses for ``x-gateway-destination-endpoint``, best first.
    :param placement: / :param attempt: the decision and its booking (generation routes).
    """

    endpoint: Endpoint | None
    destination: str
    placement: Placement | None = None
    attempt: Attempt | None = None
    replica: str | None = None
    sees_first_token: bool = True
    started: float = field(default_factory=time.monotonic)
    done: bool = False

    def receipt(self) -> dict[str, str]:
        """The decision's headers on the answer (as the proxy sets them)."""
        if self.attempt is None or self.placement is None:
            return {REPLICA_HEADER: self.replica} if self.replica else {}
        headers = {
            REPLICA_HEADER: self.attempt.replica,
            PREDICTED_HEADER: str(self.attempt.score.matched_tokens),
            DECISION_HEADER: f"{self.placement.stages.get('total', 0.0) * 1000:.3f}",
        }
        if self.placement.fallback is not None:
            headers[FALLBACK_HEADER] = self.placement.fallback
        return headers


class EndpointPicker:
    """Places requests for a gateway and keeps their attempts' books.

    :param settings: ``retries`` bounds the fallbacks named after the pick.
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        decider: Decider,
        replicas: ReplicaSet,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.decider = decider
        self.replicas = replicas
        self.metrics = metrics
        self.endpoints = Endpoints(replicas)
        self._turn = itertools.count()

    async def pick(
        self,
        path: str,
        body: bytes,
        allowed: Collection[str] | None,
        *,
        sees_first_token: bool,
        session: str | None = None,
    ) -> Pick:
        """Place the request to ``path`` with ``body`` among the ``allowed`` addresses (None:
        any) and book the pick.

        :param sees_first_token: the gateway will show the response body (its first chunk
            is the first token); otherwise the prefill is taken as done when expected.
        :param session: the request's session header (:meth:`session_of`).
        :raises RouterError: the request is refused (its status is the answer's).
        """
        among = None if allowed is None else self.endpoints.among(allowed)
        endpoint = route_of(path)
        if endpoint is None:
            return self._on_load(among)
        request = parse(body, endpoint, session)
        placement = await self.decider.place(request, among=among)
        sees_first_token = sees_first_token and request.stream
        order = list(self.replicas.in_rotation(placement.order()))[: self.settings.retries + 1]
        if not order:
            raise NoReplicaError("no healthy replica left to try")
        attempt = self.decider.commit(placement, order[0].id, sees_first_token=sees_first_token)
        destination = ",".join(self.endpoints.address(r) for r in order)
        return Pick(endpoint, destination, placement, attempt, order[0].id, sees_first_token)

    def session_of(self, headers: Mapping[str, str]) -> str | None:
        """The session a request's headers name (``--session-header``), if any."""
        name = self.settings.session_header
        return headers.get(name.lower()) if name else None

    def _on_load(self, among: frozenset[str] | None) -> Pick:
        """Another route (``/v1/models``, …): any healthy allowed replica, in turn."""
        healthy = [r for r in self.replicas.all() if r.healthy and (among is None or r.id in among)]
        if not healthy:
            raise NoReplicaError("no healthy replica can take the request")
        replica = healthy[next(self._turn) % len(healthy)]
        return Pick(None, self.endpoints.address(replica), replica=replica.id)

    def served(self, pick: Pick, address: str | None, status: int) -> None:
        """The gateway's answer began: from ``address`` (None: not said) with ``status``.

        A pick the gateway could not use (its retries went elsewhere) is taken back and the
        attempt booked where the answer came from; a gateway error without an endpoint that
        served means the pick was never reached.
        """
        attempt = pick.attempt
        if attempt is None or pick.placement is None:
            return
        served = self.endpoints.replica_at(address) if address else None
        if served is not None and served.id != attempt.replica:
            self._moved(pick, attempt, served)
        elif served is None and address is None and status in (502, 503, 504):
            self.decider.fail(attempt)
            self.replicas.failed(attempt.replica, f"the gateway answered {status}")

    def _moved(self, pick: Pick, attempt: Attempt, served: Replica) -> None:
        assert pick.placement is not None
        self.decider.fail(attempt)
        self.metrics.epp_reroutes.labels(attempt.replica).inc()
        self.replicas.failed(attempt.replica, "the gateway served the request elsewhere")
        pick.attempt = self.decider.commit(
            pick.placement, served.id, sees_first_token=pick.sees_first_token
        )
        pick.replica = served.id

    def refused(self, path: str, error: BaseException) -> None:
        """The gateway answers the request with an error of ours (counted)."""
        endpoint = route_of(path) or "other"
        self.metrics.requests.labels(endpoint, str(status_of(error)), "").inc()

    def first_token(self, pick: Pick) -> None:
        if pick.attempt is not None:
            self.decider.first_token(pick.attempt)

    def finish(
        self,
        pick: Pick,
        outcome: str,
        status: int,
        cached_tokens: int | None,
        *,
        unseen: bool = False,
    ) -> None:
        """The response ended (idempotent): counted, and the attempt finished.

        :param unseen: the gateway showed only the response's headers (its body skipped), so
            the end of the generation cannot be seen: the attempt is held until its expected
            first token, the prefill the load it books stands for.
        """
        if pick.done:
            return
        attempt = pick.attempt
        if unseen and attempt is not None and attempt.first_token_at is None:
            left = attempt.dispatched + attempt.score.expected_ttft_ms / 1000 - time.monotonic()
            if left > 0:
                loop = asyncio.get_running_loop()
                loop.call_later(left, self.finish, pick, outcome, status, cached_tokens)
                return
        pick.done = True
        endpoint = pick.endpoint or "other"
        self.metrics.requests.labels(endpoint, str(status), pick.replica or "").inc()
        self.metrics.duration.labels(endpoint).observe(time.monotonic() - pick.started)
        if outcome == "client_disconnect":
            self.metrics.disconnects.labels(endpoint).inc()
        if pick.attempt is not None:
            self.decider.finish(pick.attempt, outcome, cached_tokens)
