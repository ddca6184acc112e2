"""A gate's turns never walk its windows: admissions price windows on O(log n)
queries of the book (`older_window_blocks`, the late windows), and a turn's usage
reprices its window (`Lease.learn`) without building what the price does not read."""

from __future__ import annotations

from collections import OrderedDict

from kvgate.gate.gate import Gate
from kvgate.gate.metrics import GateMetrics
from tests.gate.helpers import FakeClock, FakeProbe, assert_clean, body, settings


class NoWalk(OrderedDict):
    """The book's windows, made to fail any walk over them (lookups and updates still work)."""

    def __iter__(self):
        raise AssertionError("a turn walked the windows")

    def values(self):
        raise AssertionError("a turn walked the windows")

    def items(self):
        raise AssertionError("a turn walked the windows")


class TickingClock(FakeClock):
    """Every reading moves the clock on 1 ms: an attempt has always waited a little when it
    decides (so a newcomer's view reads the late windows), and windows go idle, late and
    quiet as the rounds go by."""

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


async def test_turns_of_many_sessions_never_walk_the_windows(metrics: GateMetrics):
    clock = TickingClock()
    probe = FakeProbe(usage=0.02, total=1_000_000, free=980_000, block_size=16)
    gate = Gate("r0", probe, settings(quiet_floor_sec=0.5, wait_cap_factor=2.0), metrics, clock)
    gate._book.windows = NoWalk()
    reasons: dict[str, int] = {}
    for _ in range(3):
        for i in range(300):
            lease = await gate.acquire(f"s{i}", "chat", body(f"s{i}", "hello " * (i % 7)))
            lease.learn(8 + i % 5, None)
            lease.release()
            reasons[lease.reason] = reasons.get(lease.reason, 0) + 1
    # every turn was priced and booked in a window: newcomers and holders, late windows about
    assert set(reasons) == {"window_fits", "holds_window"} and sum(reasons.values()) == 900
    assert gate._book.windows_idle > 0 and gate._book.window_blocks > 0
    assert gate._book.window_ends["quiet"] > 0  # windows went quiet between rounds: newcomers again
    gate._book.windows = OrderedDict(gate._book.windows)  # the leak check may look
    assert_clean(gate, clock)


async def test_the_deadline_heap_holds_one_live_entry_per_session_not_one_per_turn(metrics: GateMetrics):
    """A session idle again before its heap entry is due keeps that entry (`purge` moves it
    on to the session's deadline then): its turns, a second apart, leave at most one live
    entry and one stale one in the heap, not one per turn of a quiet lifetime (or of a
    whole idle grace)."""
    clock = FakeClock()
    probe = FakeProbe(usage=0.02, total=1_000_000, free=980_000, block_size=16)
    gate = Gate("r0", probe, settings(idle_grace_sec=60.0, quiet_floor_sec=0.5), metrics, clock)
    for _ in range(600):  # a turn a second, for ten minutes
        lease = await gate.acquire("s", "chat", body("s"))
        clock.advance(0.1)
        lease.release()
        clock.advance(0.9)
    quiet = gate._book.quiet_lifetime(gate._book.records["s"])
    assert 2 < quiet < 10  # several turns fall within a quiet lifetime
    assert len(gate._book._deadlines) <= 2
    quiet_ends = gate._book.window_ends["quiet"]
    clock.advance(quiet)
    gate.counts()  # purges: the window goes quiet, and the record's grace is scheduled
    assert gate._book.window_ends["quiet"] == quiet_ends + 1 and "s" in gate._book.records
    clock.advance(60.0)
    assert_clean(gate, clock)
