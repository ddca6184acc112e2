"""Where a turn goes: the session's pinned replica, and where it goes again after a
failure. Pure decisions; `proxy.forward` carries them out.

Invariants:
- A session keeps its remembered replica while that replica is healthy and still
  registered (draining does not move it); otherwise the balancer chooses.
- A turn is re-sent at most once per kind of failure: once when the gate says the
  replica left while the turn waited (`Failure.UNAVAILABLE`), once when no connection
  to the replica could be opened (`Failure.CONNECT`, the request never reached it).
- Between tiers, a replica that still has requests in flight is alive, only slow to
  accept (an overloaded replica gate): a failed connect neither marks it failed nor
  moves the session; the turn is re-sent to it once (proxy/topology.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvgate.balancer import Replica
from kvgate.proxy.session_tracker import SessionEntry


def pinned_replica(entry: SessionEntry | None) -> Replica | None:
    """The replica the session ran on, while it may still serve it; None: let the balancer choose."""
    if entry is None:
        return None
    pinned = entry.replica
    if pinned is not None and pinned.healthy and not pinned.removed:
        return pinned
    return None


def others(routable: tuple[Replica, ...], replica: Replica) -> tuple[Replica, ...]:
    """The replicas a turn held on `replica` may move to (`gate/relocation.py`): the other routable ones."""
    return tuple(r for r in routable if r is not replica)


def moved_to(routable: tuple[Replica, ...], name: str, replica: Replica) -> Replica:
    """The routable replica `name` a held turn moved to, or its own `replica` if that one stopped
    being routable meanwhile (the turn acquires there again, without moving)."""
    return next((r for r in routable if r.name == name), replica)


class Failure(enum.Enum):
    """Why a turn's replica could not take it, when sending it elsewhere is safe."""

    UNAVAILABLE = "unavailable"  # the gate: the replica left while the turn waited for admission
    CONNECT = "connect"  # no connection could be opened: the request never reached the replica


class Resend(enum.Enum):
    """Where a turn goes after a failure."""

    OTHER = "other"  # to another replica, as the balancer chooses
    SAME = "same"  # to the same replica once more (between tiers: it is busy, not dead)
    NOWHERE = "nowhere"  # the failure is the turn's answer


@dataclass(frozen=True, slots=True)
class AfterFailure:
    """What to do after a failure: mark the replica failed or not, and where the turn goes."""

    mark_failed: bool
    resend: Resend


def after_failure(failure: Failure, spent: frozenset[Failure], tiered: bool, in_flight: int) -> AfterFailure:
    """The decision after `failure` on a replica that still has `in_flight` other requests.

    `spent`: the kinds of failure this turn was already re-sent after (each at most once).
    `tiered`: this kvgate is a front door or a replica gate. Only a failed connect marks
    the replica failed, and not when between tiers it is busy with other requests.
    """
    busy = failure is Failure.CONNECT and tiered and in_flight > 0
    mark_failed = failure is Failure.CONNECT and not busy
    if failure in spent:
        return AfterFailure(mark_failed, Resend.NOWHERE)
    return AfterFailure(mark_failed, Resend.SAME if busy else Resend.OTHER)
