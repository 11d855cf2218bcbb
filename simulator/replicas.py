"""Leadtime routing as several gateway replicas do: each replica a policy of its own, routing every K-th request,
all of them beside one predictor (one `leadtime serve`, which every replica asks and teaches).

Each replica knows only the requests it routed itself, unless the replicas share their ledgers: then each change
of one replica's ledgers is applied to the others' at once (as `leadtime route --replicas-redis` does through Redis,
there within a millisecond or so). The benchmark's `leadtime_x4` and `leadtime_x4_shared` measure what sharing buys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from leadtime.router_plugin.ledgers import LedgerEvent
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.router_plugin.predicted import LeadtimePolicy


class ReplicatedPolicy:
    """Requests dealt to `replicas` in turn; each request's outcome goes back to the replica that routed it.

    Parameters
    ----------
    replicas
        Leadtime policies over one shared predictor.
    shared
        Whether each replica's ledger changes are applied to every other replica's ledgers.
    name
        The policy's name in reports.
    """

    def __init__(self, replicas: Sequence[LeadtimePolicy], shared: bool, name: str) -> None:
        if not replicas:
            raise ValueError("at least one replica")
        self.replicas = list(replicas)
        self.shared = shared
        self.name = name
        self._owner: dict[str, LeadtimePolicy] = {}
        self._next = 0
        if shared:
            for replica in self.replicas:
                others = [r for r in self.replicas if r is not replica]
                replica.ledgers.outbox = _tell(others)

    def attach(self, simulator: Any) -> None:
        for replica in self.replicas:
            replica.attach(simulator)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        replica = self._owner.get(request.request_id)  # a held request comes back to the replica that held it
        if replica is None:
            replica = self._owner[request.request_id] = self.replicas[self._next % len(self.replicas)]
            self._next += 1
        return replica.pick(request, candidates)

    def observe(self, outcome: Outcome) -> None:
        self._owner.pop(outcome.request_id).observe(outcome)

    def abandon(self, request_id: str) -> None:
        """A request that will not complete (it failed) is let go of by the replica that routed it, which tells the
        others when they share their ledgers; unknown: nothing to do."""
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.abandon(request_id)

    def forget_endpoint(self, endpoint_id: str) -> None:
        """An endpoint that left the fleet is forgotten by every replica (each keeps its own per-endpoint state)."""
        for replica in self.replicas:
            replica.forget_endpoint(endpoint_id)


def _tell(others: list[LeadtimePolicy]) -> Callable[[LedgerEvent], None]:
    def outbox(event: LedgerEvent) -> None:
        for other in others:
            other.ledgers.apply(event)

    return outbox
