"""The one percentile definition of kvgate's reports: nearest rank.

The simulator's admission experiment (P50/P95 TTFT and E2E in steps), the benchmarks'
latency summaries and the tests' printed figures all use it, so a "p95" means the same
thing in every report. Nearest rank returns a value that was observed (a whole number
of engine steps stays whole; a p95 of twenty turns is the slowest-but-one turn, not a
blend of two), and it needs no interpolation rule to agree on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar, overload

T = TypeVar("T", int, float)


@overload
def percentile(values: Iterable[T], pct: float) -> T | None: ...


@overload
def percentile(values: Iterable[T], pct: float, empty: T) -> T: ...


def percentile(values: Iterable[T], pct: float, empty: T | None = None) -> T | None:
    """The nearest-rank `pct`-th percentile (0 < pct <= 100) of `values`, in any order:
    the smallest value with at least pct% of the values at or below it. `empty` when
    there are none (None, or e.g. math.nan for a float field)."""
    ordered = sorted(values)
    if not ordered:
        return empty
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]
