"""Moving a held turn to a replica that has nothing to do.

A turn the gate holds waits for its replica's cache. Where another replica has nothing
in flight and nothing waiting, that replica's compute goes unused meanwhile; at the end
of a rollout one replica often still runs its longest sessions while the others are
done. The held turn moves there once it has waited as long as re-prefilling its prompt
takes (ski rental: by then it has paid in waiting what the move costs; the replica's
measured prefill throughput prices it), and its session stays there: its window on the
old replica ends, and its later turns hit on the new one.

Rules (each has a test, `tests/gate/test_relocation.py`):
- only a named turn the gate holds moves, in enforce mode, with `gate.relocate_held`, when
  no other turn of its session is in flight or acquiring on its replica (a session runs
  on one replica);
- only to a replica its caller offers (routable, not this one) whose gate enforces and has
  no lease out and no waiter, and that no other moved turn claimed in the last
  `CLAIM_SEC` (so a burst of held turns does not pile onto one idle replica);
- a turn moves at most once (its caller offers no other replica the second time);
- a replica that goes idle wakes the other replicas' waiters, so they can move now.
"""

from __future__ import annotations

from typing import Protocol

# How long a replica a moved turn claimed counts as busy before that turn arrives there.
CLAIM_SEC = 1.0


class Elsewhere(Protocol):
    """The other replicas a held turn may move to, as its caller offers them."""

    def idle_replica(self) -> str | None:
        """The first offered replica with nothing to do (module docstring), or None."""
        ...

    def claim(self, name: str) -> None:
        """A held turn moves to `name`: it is not idle until the turn arrives."""
        ...


def relocation_due_sec(
    prompt_tokens: int | None, prefill_tokens_per_sec: float | None, waited_sec: float
) -> float | None:
    """Seconds until a held turn of `prompt_tokens` may move, having waited `waited_sec` (<= 0:
    now): the time re-prefilling its prompt takes at `prefill_tokens_per_sec`, less its wait.
    None: it may not move (its prompt or the replica's prefill throughput is unknown)."""
    if not prompt_tokens or not prefill_tokens_per_sec:
        return None
    return prompt_tokens / prefill_tokens_per_sec - waited_sec
