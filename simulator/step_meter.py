"""What the engine measures about its own speed, for the probe API's `GET /v1/kvgate/kv`.

`StepMeter` turns the wall time of each engine step into the three figures the gate's
work-conserving rule weighs (docs/gate.md):

- `decode_step_sec`: the seconds of a step that only decoded (its fixed cost plus one
  token of every running sequence);
- `prefill_tokens_per_sec`: prompt tokens per second of the time prefill *added* to a
  step: a step that computed prompt tokens, minus the decode step it also was and the
  time it spent loading blocks from a CPU tier (a load is not a prefill: vLLM's loads
  do not run in its steps at all);
- `prefill_share`: of the engine's recent busy time, the part prefill added;
- `busy_share`: of the engine's recent wall time, the part spent in steps
  (`kvgate.wire.busy_share`; needs each step's end time and the reading's time).

The rates are smoothed per step (EWMA, `weight` on the newest step); the share over
busy time (its two sums decay by exp(-seconds / `horizon_sec`) each step, so it
follows the last few seconds of work, not the last few steps: a run of short decode
steps does not swing it). Each is None until a step of its kind ran: the gate then
knows it has no measurement yet. Pure: no clock, the caller passes the step's seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvgate.wire.busy_share import BusyMeter


@dataclass
class StepMeter:
    weight: float = 0.2
    horizon_sec: float = 2.0
    prefill_tokens_per_sec: float | None = None
    decode_step_sec: float | None = None
    _prefill_time: float = 0.0  # decayed seconds that prefill added, and decayed busy seconds
    _busy_time: float = 0.0
    _busy: BusyMeter = field(init=False)
    observations: int = field(default=0, init=False)  # steps observed: a reading changes only with them and `now`

    def __post_init__(self) -> None:
        self._busy = BusyMeter(self.horizon_sec)  # the busy share decays as the prefill share does

    def observe(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        seconds: float,
        ended_at: float | None = None,
        load_seconds: float = 0.0,
    ) -> None:
        """One engine step: `prefill_tokens` prompt tokens computed, `decode_seqs` sequences
        decoded, `seconds` of wall time (`load_seconds` of them loading from a CPU tier),
        ending at `ended_at` (the engine's clock; None: the step does not count in the
        busy share). A step of no measurable time is skipped."""
        if seconds <= 0:
            return
        self.observations += 1
        if ended_at is not None:
            self._busy.observe(ended_at, seconds)
        added = 0.0
        if prefill_tokens > 0:
            added = seconds - load_seconds - (self.decode_step_sec or 0.0)
            if added > 0:
                self.prefill_tokens_per_sec = self._smooth(self.prefill_tokens_per_sec, prefill_tokens / added)
            added = max(0.0, added)
        elif decode_seqs > 0:
            self.decode_step_sec = self._smooth(self.decode_step_sec, seconds)
        keep = math.exp(-seconds / self.horizon_sec)
        self._busy_time = self._busy_time * keep + seconds
        self._prefill_time = self._prefill_time * keep + added

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def reading(self, now: float | None = None) -> dict:
        """The probe API's optional fields (None: not measured yet); the busy share as of
        `now` (the clock the steps' ends were given in; None: not reported)."""
        share = self._prefill_time / self._busy_time if self._busy_time > 0 else None
        return {
            "prefill_tokens_per_sec": self.prefill_tokens_per_sec,
            "decode_step_sec": self.decode_step_sec,
            "prefill_share": share,
            "busy_share": None if now is None else self._busy.share(now),
        }
