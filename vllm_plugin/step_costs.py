"""The engine's marginal cost of a token, fitted from its own scheduler steps (pure).

The gate's work-conserving rule prices the re-prefill an admission causes in engine
seconds (docs/gate.md). What that costs is the *marginal* time of the extra tokens
in the steps that compute them, not a request's prefill time: batched into a step
beside other requests' decodes, a re-prefill adds its tokens' compute, not another
step. vLLM's request counters cannot tell the two apart (on a small model they
report several times fewer tokens per second than a longer prompt really costs, and
the gate would hold turns whose re-prefill is nearly free). So the engine plugin
times every scheduler step and records how many tokens it scheduled (`StepLog`), and `marginal_token_sec` fits
step seconds = overhead + tokens x marginal seconds per token by least squares.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvgate.wire.busy_share import BusyMeter

MAX_STEPS = 512  # the fit covers the engine's most recent steps
MIN_STEPS = 32  # fewer: no figure yet
# The fit needs steps of different sizes; a spread of tokens below this (decode-only
# steps of similar batches) says nothing about a prefill's cost.
MIN_TOKEN_SPREAD = 64


class StepLog:
    """The engine's recent steps as (seconds, scheduled tokens), and its busy share
    (`busy`: `kvgate.wire.busy_share`, from the steps' ends); O(1) per step."""

    __slots__ = ("steps", "busy")

    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self.steps: deque[tuple[float, int]] = deque(maxlen=max_steps)
        self.busy = BusyMeter()

    def record(self, seconds: float, tokens: int, ended_at: float | None = None) -> None:
        """A step of `seconds` that scheduled `tokens`, ending at `ended_at` (a monotonic
        clock's reading; None: not counted in the busy share)."""
        if tokens > 0 and seconds >= 0:  # an empty step computed nothing
            self.steps.append((seconds, tokens))
            if ended_at is not None:
                self.busy.observe(ended_at, seconds)


def marginal_token_sec(steps: Iterable[tuple[float, int]]) -> float | None:
    """Least-squares slope of step seconds over scheduled tokens: the engine seconds one
    more token costs in a step. None with fewer than MIN_STEPS steps, a token spread
    below MIN_TOKEN_SPREAD, or a slope that is not positive (noise swamped it)."""
    samples = list(steps)
    n = len(samples)
    if n < MIN_STEPS:
        return None
    tokens = [t for _, t in samples]
    if max(tokens) - min(tokens) < MIN_TOKEN_SPREAD:
        return None
    mean_t = sum(tokens) / n
    mean_s = sum(s for s, _ in samples) / n
    covariance = sum((t - mean_t) * (s - mean_s) for s, t in samples)
    variance = sum((t - mean_t) ** 2 for t in tokens)
    slope = covariance / variance
    return slope if slope > 0 else None
