"""An asyncio event loop whose clock is the simulation's own.

`VirtualTimeLoop.time()` returns virtual seconds. When no callback is ready, the loop
jumps its clock to the earliest timer instead of waiting for it, so `asyncio.sleep`,
`asyncio.timeout`, `loop.call_at` and everything built on them (the gate's waits and
polls) run in simulated time, as fast as the CPU allows.

Invariants:
- the clock never goes backwards, and it only moves when nothing is ready to run;
- a jump lands exactly on the earliest timer's `when()` (no float drift between a
  timer's deadline and the clock it fires at);
- timers due at the same instant fire in the order they were set, whatever else is
  scheduled (asyncio's heap alone breaks such ties by its shape);
- the loop never waits on real I/O: a run with nothing ready and no timer left is a
  deadlock in the simulated program, raised as `SimulationDeadlock` instead of hanging.

The order in which ready callbacks run is asyncio's own (FIFO, timers by deadline), so
a program that does not read the wall clock or iterate unordered containers runs the
same way every time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Nothing is ready and nothing is scheduled: the simulated program waits forever."""


class _VirtualSelector(selectors.BaseSelector):
    """A selector with no file descriptors to watch: `select(timeout)` advances the clock."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualTimeLoop | None = None

    def register(self, fileobj, events, data=None) -> selectors.SelectorKey:
        # Only the loop's own self-pipe is registered (for call_soon_threadsafe); it never fires here.
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list:
        assert self.loop is not None
        if timeout is None:
            raise SimulationDeadlock("the simulation has nothing ready and no timer: it would wait forever")
        if timeout > 0:
            self.loop.jump()
        return []

    def get_map(self):
        return self._map

    def close(self) -> None:
        self._map.clear()


class _OrderedTimerHandle(asyncio.TimerHandle):
    """A timer that sorts by (deadline, creation order): timers due at the same instant
    fire in the order they were set, whatever else the heap holds. Every timer of a
    VirtualTimeLoop is one (`call_at` makes them all), so they compare with each other
    only; the heap compares with `<` alone, the hottest call of a large simulation."""

    __slots__ = ("_order",)

    def __init__(self, when, callback, args, loop, context, order: int) -> None:
        super().__init__(when, callback, args, loop, context)
        self._order = order

    def __lt__(self, other):
        when, other_when = self._when, other._when  # type: ignore[attr-defined]  # TimerHandle's slot
        return when < other_when or (when == other_when and self._order < other._order)

    def __le__(self, other):
        return self < other or self == other


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop on a virtual clock starting at `start` seconds."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = start
        self._timer_order = itertools.count()

    def call_at(self, when, callback, *args, context=None):  # type: ignore[override]
        """asyncio's call_at with ties broken by creation order (asyncio's heap breaks them
        by the heap's shape, which any unrelated timer changes)."""
        self._check_closed()  # type: ignore[attr-defined]
        timer = _OrderedTimerHandle(when, callback, args, self, context, next(self._timer_order))
        if timer._source_traceback:  # type: ignore[attr-defined]
            del timer._source_traceback[-1]  # type: ignore[attr-defined]
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def time(self) -> float:
        return self._now

    def jump(self) -> None:
        """Move the clock to the earliest timer (called only when nothing is ready)."""
        # asyncio's timer heap (stable since 3.4); it drops cancelled timers from its head
        # before it selects, so the head is the next timer that will fire.
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if scheduled:
            self._now = max(self._now, scheduled[0].when())


def run_virtual(main: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Run `main` to completion on a fresh VirtualTimeLoop and close the loop."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
