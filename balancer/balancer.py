"""Replica choice: sticky by session id, least loaded for anonymous requests.

Sessions: rendezvous hashing of the session id over the routable replicas
(`rendezvous`), or the same order skipping replicas whose in-flight load exceeds
`load_factor` x mean (`bounded_load`). Where the caller counts each replica's sessions
(`sessions_on`: the gates' books, `gate.place_sessions`), the routable replica with the
fewest per unit of weight instead, ties going to the earliest in the session's
rendezvous order. The proxy asks only for a session it has not pinned to a replica yet
(proxy.turn_route). Anonymous requests: the routable replica
with the fewest in-flight requests per unit of weight, ties rotated so that
sequential requests spread.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

from kvgate.balancer.hashing import bounded_load_pick, rendezvous_order, rendezvous_score
from kvgate.balancer.registry import Replica, ReplicaRegistry
from kvgate.balancer.settings import BalancerSettings

ALGORITHMS = ("rendezvous", "bounded_load")


def _name(r: Replica) -> str:
    return r.name


def _weight(r: Replica) -> float:
    return r.weight


def _load(r: Replica) -> int:
    return r.in_flight


class Balancer:
    def __init__(self, registry: ReplicaRegistry, settings: BalancerSettings | None = None) -> None:
        self.registry = registry
        self.settings = settings or BalancerSettings()
        if self.settings.algorithm not in ALGORITHMS:
            raise ValueError(f"balancer.algorithm must be one of {ALGORITHMS}, got {self.settings.algorithm!r}")
        self._tie = count()

    def choose(
        self,
        session_id: str | None,
        exclude: Replica | None = None,
        sessions_on: Callable[[Replica], int] | None = None,
    ) -> Replica | None:
        """The replica for this request, or None when no replica is routable. `sessions_on`:
        how many sessions a replica serves, to place a session on the one with the fewest."""
        candidates = self.registry.routable()
        if exclude is not None:
            candidates = tuple(r for r in candidates if r is not exclude)
        if not candidates:
            return None
        if session_id is None:
            return self._least_loaded(candidates)
        if len(candidates) == 1:
            return candidates[0]
        if sessions_on is not None:
            ordered = rendezvous_order(session_id, candidates, _name, _weight)
            return min(ordered, key=lambda r: sessions_on(r) / r.weight)  # the first of the fewest
        if self.settings.algorithm == "bounded_load":
            ordered = rendezvous_order(session_id, candidates, _name, _weight)
            return bounded_load_pick(ordered, _load, self.settings.load_factor)
        return min(candidates, key=lambda r: (-rendezvous_score(r.name, r.weight, session_id), r.name))

    def _least_loaded(self, candidates: tuple[Replica, ...]) -> Replica:
        n = len(candidates)
        start = next(self._tie) % n
        best: Replica | None = None
        best_load = 0.0
        for i in range(n):
            r = candidates[(start + i) % n]
            load = r.in_flight / r.weight
            if best is None or load < best_load:
                best, best_load = r, load
        assert best is not None  # candidates is not empty
        return best
