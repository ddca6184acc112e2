"""What the engine measures about its own speed, for the probe API's `GET /v1/kvgate/kv`.

`StepMeter` turns the wall time of each engine step into the two figures the gate's
work-conserving rule weighs (docs/gate.md): prefill throughput (prompt tokens per
second of the steps that computed prompt tokens), the decode step time (seconds of
a step that only decoded) and the prefill share (of the engine's recent busy time,
the part spent in steps that computed prompt tokens). Both are smoothed (EWMA, `weight` on the newest step) so
one slow step moves them little; both are None until a step of that kind ran: the
gate then knows it has no measurement yet. Pure: no clock, the caller passes seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepMeter:
    weight: float = 0.2
    prefill_tokens_per_sec: float | None = None
    decode_step_sec: float | None = None
    _prefill_time: float = 0.0  # decayed seconds of prefill steps, and of all steps
    _busy_time: float = 0.0

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """One engine step: `prefill_tokens` prompt tokens computed, `decode_seqs` sequences
        decoded, `seconds` of wall time (a step of no measurable time is skipped)."""
        if seconds <= 0:
            return
        keep = 1.0 - self.weight
        self._busy_time = self._busy_time * keep + seconds
        self._prefill_time = self._prefill_time * keep + (seconds if prefill_tokens > 0 else 0.0)
        if prefill_tokens > 0:
            rate = prefill_tokens / seconds
            old = self.prefill_tokens_per_sec
            self.prefill_tokens_per_sec = rate if old is None else old + self.weight * (rate - old)
        elif decode_seqs > 0:
            old = self.decode_step_sec
            self.decode_step_sec = seconds if old is None else old + self.weight * (seconds - old)

    def reading(self) -> dict:
        """The probe API's optional fields (None: not measured yet)."""
        share = self._prefill_time / self._busy_time if self._busy_time > 0 else None
        return {"prefill_tokens_per_sec": self.prefill_tokens_per_sec, "decode_step_sec": self.decode_step_sec,
                "prefill_share": share}
