"""The engine's marginal cost of a token, fitted from its own scheduler steps (pure).

The gate's work-conserving rule prices the re-prefill an admission causes in engine
seconds (docs/gate.md). What that costs is the *marginal* time of the extra tokens
in the steps that compute them, not a request's prefill time: batched into a step
beside other requests' decodes, a re-prefill adds its tokens' compute, not another
step. vLLM's request counters cannot tell the two apart (on a small model they
report several times fewer tokens per second than a longer prompt really costs, and
the gate would hold turns whose re-prefill is nearly free). So the engine plugin
times every scheduler step and records how many tokens it scheduled (`StepLog`), and `marginal_token_sec` fits
step seconds = overhead + tokens x marginal seconds per token by least squares
(`kvgate.wire.step_fit`).

With `KVGATE_STEP_LOG` set to a file path in the engine's environment, the log also
appends each step there as a line `seconds tokens` (`step_sink_from_env`): the timings a
simulated replica's cost model is fitted from (docs/simulator.md).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from typing import TextIO

from kvgate.wire.busy_share import BusyMeter
from kvgate.wire.step_fit import fit_step_seconds

MAX_STEPS = 512  # the fit covers the engine's most recent steps
STEP_LOG_ENV = "KVGATE_STEP_LOG"  # a file every step is appended to, as `seconds tokens`


class StepLog:
    """The engine's recent steps as (seconds, scheduled tokens), and its busy share
    (`busy`: `kvgate.wire.busy_share`, from the steps' ends); O(1) per step. With a `sink`,
    every recorded step is also written to it as a line `seconds tokens`."""

    __slots__ = ("steps", "busy", "sink")

    def __init__(self, max_steps: int = MAX_STEPS, sink: TextIO | None = None) -> None:
        self.steps: deque[tuple[float, int]] = deque(maxlen=max_steps)
        self.busy = BusyMeter()
        self.sink = sink

    def record(self, seconds: float, tokens: int, ended_at: float | None = None) -> None:
        """A step of `seconds` that scheduled `tokens`, ending at `ended_at` (a monotonic
        clock's reading; None: not counted in the busy share)."""
        if tokens > 0 and seconds >= 0:  # an empty step computed nothing
            self.steps.append((seconds, tokens))
            if ended_at is not None:
                self.busy.observe(ended_at, seconds)
            if self.sink is not None:
                self.sink.write(f"{seconds:.6f} {tokens}\n")


def step_sink_from_env() -> TextIO | None:
    """The file `KVGATE_STEP_LOG` names, opened to append a line per step (line-buffered, so
    a stopped server leaves whole lines); None when it is unset or empty."""
    path = os.environ.get("KVGATE_STEP_LOG")  # STEP_LOG_ENV, spelled out for the docs' check of what is read
    return open(path, "a", buffering=1) if path else None  # noqa: SIM115 (lives as long as the engine)


def marginal_token_sec(steps: Iterable[tuple[float, int]]) -> float | None:
    """The slope of `fit_step_seconds`: the engine seconds one more token costs in a step."""
    fit = fit_step_seconds(steps)
    return None if fit is None else fit[1]
