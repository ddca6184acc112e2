"""What the probe API's `token_sec` measures, and how a step log is fitted (pure).

`token_sec` is an engine's marginal seconds per scheduled token: the slope of the
least-squares line step seconds = overhead + tokens x seconds per token through its
recent timed scheduler steps (the vLLM plugin's `StepLog`). The same line, intercept
included, is what a simulation of the engine is calibrated from
(`kvgate.bench.agentic.cpu_engines`).
"""

from __future__ import annotations

from collections.abc import Iterable

MIN_STEPS = 32  # fewer: no figure yet
# The fit needs steps of different sizes; a spread of tokens below this (decode-only
# steps of similar batches) says nothing about a prefill's cost.
MIN_TOKEN_SPREAD = 64


def fit_step_seconds(steps: Iterable[tuple[float, int]]) -> tuple[float, float] | None:
    """(overhead, seconds per token): the least-squares line of step seconds over scheduled
    tokens. None with fewer than MIN_STEPS steps, a token spread below MIN_TOKEN_SPREAD, or
    a slope that is not positive (noise swamped it)."""
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
    return (mean_s - slope * mean_t, slope) if slope > 0 else None
