"""The virtual-time loop: its clock jumps to the next timer, ties fire in the order set, a
program with nothing left to wait for raises instead of hanging."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvgate.simulator.virtual_loop import SimulationDeadlock, run_virtual


def test_an_hour_of_sleeps_and_timeouts_takes_no_wall_time():
    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.sleep(10)
        return loop.time()

    started = time.perf_counter()
    assert run_virtual(main()) == 3605.0
    assert time.perf_counter() - started < 5


def test_timers_due_together_fire_in_the_order_they_were_set():
    async def main():
        loop = asyncio.get_running_loop()
        fired: list[int] = []
        for i in range(40):  # other timers give asyncio's heap a shape that scrambles its ties
            loop.call_at(5.0 + (i % 7) * 0.25, lambda: None)
        for i in range(30):
            loop.call_at(3.0, fired.append, i)
            loop.call_at(4.0 + (i % 3), lambda: None)
        await asyncio.sleep(10)
        return fired

    assert run_virtual(main()) == list(range(30))


def test_waiting_forever_is_an_error_not_a_hang():
    async def main():
        await asyncio.Event().wait()

    with pytest.raises(SimulationDeadlock):
        run_virtual(main())


def test_cancelled_timers_never_fire_and_the_rest_keep_their_order():
    """Enough cancelled timers make the loop sweep its heap at once (asyncio's rule); the
    timers left still fire by (deadline, order set), and no cancelled one fires."""

    async def main():
        loop = asyncio.get_running_loop()
        fired: list[int] = []
        handles = [loop.call_at(1.0 + (i % 5), fired.append, i) for i in range(300)]
        for i, handle in enumerate(handles):
            if i % 4:  # three in four cancelled: past the sweep's threshold
                handle.cancel()
        await asyncio.sleep(10)
        return fired

    kept = [i for i in range(300) if i % 4 == 0]
    assert run_virtual(main()) == sorted(kept, key=lambda i: (1.0 + (i % 5), i))
