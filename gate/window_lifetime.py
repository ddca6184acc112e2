"""How long a session's idle window lives, and when its session is late (pure).

The book ends an idle window at its quiet deadline (`quiet_lifetime`), and the policies
and the late index read which idle windows are late (`late_after`): both from the same
gaps between turns, the session's own when measured, else the replica's.
"""

from __future__ import annotations


def quiet_lifetime(
    session_gap: float | None, replica_gap: float | None, factor: float, floor: float, ceiling: float
) -> float:
    """How long an idle window lives: `factor` x the session's usual gap between turns
    (else the replica's, for a session with no gap yet), at least `floor`, at most
    `ceiling` (`idle_grace_sec`). A session that ends without saying so frees its
    window about `factor` tool calls after its last turn instead of after the grace.
    With no gap measured anywhere: the floor."""
    gap = session_gap if session_gap is not None else replica_gap
    lifetime = floor if gap is None else max(floor, factor * gap)
    return max(0.0, min(lifetime, ceiling))


def late_after(session_gap: float | None, replica_gap: float | None, floor: float) -> float:
    """How long an idle window's session may be idle before it is late: its usual gap
    between turns (else the replica's), at least `floor` (`late_floor_sec`). A late
    session sits in an unusually long tool call, or has gone quietly: of all windows,
    its blocks are the least likely to be read again soon."""
    gap = session_gap if session_gap is not None else replica_gap
    return floor if gap is None else max(floor, gap)
