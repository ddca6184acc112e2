"""The highest of the last few values seen: what the gate's books take as a replica's
observed bound (a prompt's tokens per body byte, a reply's tokens).

Read at every decision and changed once per served turn: the maximum is kept, and
recomputed (O(window)) only when the value that held it leaves the window.
"""

from __future__ import annotations

from collections import deque


class RecentMax:
    """The highest of the last `window` values added; None before the first.

    Invariant: `_highest` is None or the maximum of `_values`."""

    def __init__(self, window: int) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._highest: float | None = None

    def add(self, value: float) -> None:
        values, highest = self._values, self._highest
        leaving = values[0] if len(values) == values.maxlen else None
        values.append(value)
        if highest is not None and value >= highest:
            self._highest = value
        elif leaving is not None and leaving == highest:
            self._highest = None

    @property
    def value(self) -> float | None:
        if self._highest is None:
            self._highest = max(self._values, default=None)
        return self._highest
