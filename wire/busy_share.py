"""What the probe API's `busy_share` measures, and how a server measures it (pure).

`busy_share` is the share of the engine's recent wall time spent in scheduler steps,
in [0, 1]: 1 when the engine steps back to back (every second a turn is held back, it
computes for others), 0 when it idles. Recent: every instant of a step and of the wall time
since the meter began weighs exp(-age / `horizon_sec`), so the share follows the last
few seconds, and a meter younger than its horizon divides by the wall time it has
seen, not by the horizon. A step weighs the integral of that over its own seconds, so
a step as long as the horizon counts as what it is, not as if it had all happened at
its end (a CPU engine's prefill steps take seconds).

Both servers of the probe API (the vLLM plugin, timing `EngineCore.step`; the
simulated replica, timing its cost model's steps) feed a `BusyMeter` with each step's
end and seconds and report `share(now)`. The gate meters the time its replica has no
turn in flight the same way (`SessionBook.empty_meter`), so the two shares compare.
O(1) per step, no clock of its own: the caller passes the times (a monotonic clock,
or the simulation's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_HORIZON_SEC = 2.0


@dataclass
class BusyMeter:
    """Decayed busy seconds over decayed wall seconds. Invariant: 0 <= `share(now)` <= 1."""

    horizon_sec: float = DEFAULT_HORIZON_SEC
    _busy: float = 0.0  # decayed step seconds, as of `_at`
    _at: float | None = None  # the end of the last step observed
    _began: float | None = None  # the start of the first step observed

    @property
    def started(self) -> bool:
        """Whether a step has been observed (`share` measures from the first one's start)."""
        return self._at is not None

    def _weighed(self, seconds: float) -> float:
        """The last `seconds` before a moment, each instant weighed by its age then:
        the integral of exp(-age / horizon) over them."""
        return -self.horizon_sec * math.expm1(-seconds / self.horizon_sec)

    def observe(self, ended_at: float, seconds: float) -> None:
        """One step of `seconds` that ended at `ended_at` (steps arrive in order)."""
        if seconds < 0:
            return
        weighed = self._weighed(seconds)  # as of the step's end
        if self._at is None or self._began is None:
            self._began, self._at = ended_at - seconds, ended_at
            self._busy = weighed
            return
        elapsed = max(0.0, ended_at - self._at)
        self._busy = self._busy * math.exp(-elapsed / self.horizon_sec) + weighed
        self._at = max(self._at, ended_at)

    def share(self, now: float) -> float | None:
        """The busy share at `now`; None before any step (no measurement)."""
        if self._at is None or self._began is None:
            return None
        since_step = max(0.0, now - self._at)
        busy = self._busy * math.exp(-since_step / self.horizon_sec)
        wall = self._weighed(max(0.0, now - self._began))  # the wall time since the meter began
        if wall <= 0:
            return None
        return min(1.0, busy / wall)
