"""An asyncio event loop whose clock is the simulation's own.

`VirtualTimeLoop.time()` returns virtual seconds. When no callback is ready, the loop
jumps its clock to the earliest timer instead of waiting for it, so `asyncio.sleep`,
`asyncio.timeout`, `loop.call_at` and everything built on them (the gate's waits and
polls) run in simulated time, as fast as the CPU allows.

Invariants:
- the clock never goes backwards, and it only moves when nothing is ready to run;
- a jump lands exactly on the earliest timer's deadline (no float drift between a
  timer's deadline and the clock it fires at);
- timers due at the same instant fire in the order they were set, whatever else is
  scheduled (asyncio's heap alone breaks such ties by its shape);
- the loop never waits on real I/O: a run with nothing ready and no timer left is a
  deadlock in the simulated program, raised as `SimulationDeadlock` instead of hanging.

The order in which ready callbacks run is asyncio's own (FIFO, timers by deadline; the
loop's `_run_once` is asyncio's with the I/O poll replaced by the jump), so
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
    """A selector with no file descriptors to watch. Only the loop's own self-pipe (for
    call_soon_threadsafe) is registered, and the loop never selects: its `_run_once`
    jumps the clock instead."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj, events, data=None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list:
        raise AssertionError("a VirtualTimeLoop never selects")

    def get_map(self):
        return self._map

    def close(self) -> None:
        self._map.clear()


# asyncio's rule for dropping cancelled timers all at once (base_events): more than this
# many timers, more than this fraction of them cancelled.
_MIN_TIMERS_TO_SWEEP = 100
_CANCELLED_FRACTION_TO_SWEEP = 0.5


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop on a virtual clock starting at `start` seconds.

    Its timer heap holds (deadline, creation order, timer) entries, so timers compare
    as tuples (the heap's comparisons are the hottest code of a large simulation) and
    timers due at the same instant fire in the order they were set. `_run_once` is
    asyncio's, with the I/O poll replaced by the jump of the clock.
    """

    # asyncio's own attributes (BaseEventLoop), as this loop uses them
    _scheduled: list[tuple[float, int, asyncio.TimerHandle]]
    _timer_cancelled_count: int

    def __init__(self, start: float = 0.0) -> None:
        super().__init__(_VirtualSelector())
        self._now = start
        self._timer_order = itertools.count()

    def call_at(self, when, callback, *args, context=None):  # type: ignore[override]
        """asyncio's call_at, its timer keyed by (deadline, creation order)."""
        self._check_closed()  # type: ignore[attr-defined]
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        if timer._source_traceback:  # type: ignore[attr-defined]
            del timer._source_traceback[-1]  # type: ignore[attr-defined]
        heapq.heappush(self._scheduled, (when, next(self._timer_order), timer))
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:
        """One iteration: drop cancelled timers (asyncio's rule), jump the clock to the
        earliest timer if nothing is ready, move the timers due to the ready queue and
        run the callbacks ready at the start of the iteration, in order."""
        scheduled = self._scheduled
        count = len(scheduled)
        if count > _MIN_TIMERS_TO_SWEEP and self._timer_cancelled_count / count > _CANCELLED_FRACTION_TO_SWEEP:
            kept = []
            for entry in scheduled:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False  # type: ignore[attr-defined]  # TimerHandle's slot
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._scheduled = scheduled = kept
            self._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0][2]._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled)[2]._scheduled = False  # type: ignore[attr-defined]
        ready = self._ready  # type: ignore[attr-defined]
        if not ready and not self._stopping:  # type: ignore[attr-defined]
            if not scheduled:
                raise SimulationDeadlock("the simulation has nothing ready and no timer: it would wait forever")
            self._now = max(self._now, scheduled[0][0])  # the jump: nothing can happen before it
        end_time = self._now + self._clock_resolution  # type: ignore[attr-defined]
        while scheduled and scheduled[0][0] < end_time:
            timer = heapq.heappop(scheduled)[2]
            timer._scheduled = False  # type: ignore[attr-defined]
            ready.append(timer)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()


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
