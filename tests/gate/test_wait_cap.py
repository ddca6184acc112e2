"""The cap on a held turn's wait: pure table tests of the rule (a window made of idle
windows once the cap runs out), the book's turn times and reclaimed windows, and the
asyncio gate letting a held turn in `wait_capped` once its cap runs out (leak-free)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from kvgate.gate.book import SessionBook, WindowEnd
from kvgate.gate.gate import Gate
from kvgate.gate.policies.economics import WAIT_CAP_FLOOR_SEC, due_by, wait_cap_left, wait_cap_sec
from kvgate.gate.policies.pricing import reclaim_window
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Wait, WaitCause
from kvgate.gate.policies.working_set import working_set_decide
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from tests.gate.helpers import FakeProbe, assert_clean, sample, settings, until

CAP_1 = GateSettings(wait_cap_factor=1.0)
HELD = Wait(WaitCause.WINDOWS_FULL, "does not fit")


@pytest.mark.parametrize(
    "factor, recent, expected",
    [
        (0.0, 0.5, None),  # factor 0: no cap
        (1.0, None, None),  # no turn has ended on the replica: nothing to measure the cap by
        (1.0, 0.5, 0.5),
        (2.0, 0.5, 1.0),
        (1.0, 0.01, WAIT_CAP_FLOOR_SEC),  # very short turns: the floor
    ],
)
def test_wait_cap_sec(factor, recent, expected):
    view = WorkingSetView(recent_turn_sec=recent)
    cap = wait_cap_sec(view, GateSettings(wait_cap_factor=factor))
    assert cap == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    "waited, recheck, left, due",
    [
        (0.0, None, 0.5, 0.5),  # due again when the cap runs out
        (0.2, None, 0.3, 0.3),
        (0.2, 0.1, 0.3, 0.1),  # an earlier recheck stays
        (0.5, None, 0.0, 0.0),  # waited its cap
    ],
)
def test_wait_cap_left_and_due_by(waited, recheck, left, due):
    view = WorkingSetView(recent_turn_sec=0.5, waited_sec=waited)
    assert wait_cap_left(view, CAP_1) == pytest.approx(left)
    assert wait_cap_left(view, GateSettings(wait_cap_factor=0)) is None
    decided = due_by(Wait(HELD.cause, HELD.why, recheck_sec=recheck), left)
    assert decided.cause == HELD.cause and decided.recheck_sec == pytest.approx(due)


# A long prompt on a busy replica with short output: the work-conserving rule holds it.
# 200 blocks: windows hold 150, 100 of them idle (sessions in tool calls, all late), 50
# in flight; vLLM counts the idle windows' cached blocks as free (140).
LONG = PrefixReading(total_blocks=110, hit_blocks=5, hit_ratio=0.05, total_tokens=1760)
USAGE = UsageReading(0.3, 200, 140, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01)
# its window: 1,760 prompt tokens + 1 output = 111 blocks
FOOTPRINT = 111


def held_view(late_window_blocks: int = 100, next_late_sec: float | None = None, **fields) -> WorkingSetView:
    base = dict(idle_window_blocks=100, older_window_blocks=150, max_output_tokens=1, last_prompt_tokens=1700)
    late = (late_window_blocks, next_late_sec)
    return WorkingSetView(**{**base, **fields}, late_windows=lambda: late)


@pytest.mark.parametrize(
    "older, idle, late, free, expected",
    [
        # books: 111 + 150 - 200 = 61 over; engine: 105 new blocks - (140 - 100) = 65 over
        (150, 100, 100, 140, (FOOTPRINT, 65)),
        (150, 100, 65, 140, (FOOTPRINT, 65)),
        (150, 100, 64, 140, None),  # the late windows are too few: the others are due back
        (150, 100, 100, 200, (FOOTPRINT, 61)),  # vLLM has room: the books decide
        (60, 10, 0, 200, (FOOTPRINT, 0)),  # fits already (a turn held behind others)
        (190, 20, 20, 140, None),  # the windows in flight alone leave too little
    ],
)
def test_reclaim_window(older, idle, late, free, expected):
    usage = UsageReading(0.3, 200, free, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01)
    view = held_view(older_window_blocks=older, idle_window_blocks=idle, late_window_blocks=late)
    assert reclaim_window(view, usage, LONG, GateSettings()) == expected


def test_the_policy_holds_until_the_cap_then_admits_into_a_window_of_idle_windows():
    no_cap = working_set_decide(
        held_view(waited_sec=5.0, recent_turn_sec=0.4), USAGE, LONG, GateSettings(wait_cap_factor=0)
    )
    assert isinstance(no_cap, Wait) and no_cap.recheck_sec is None  # the rule alone: held, however long
    early = working_set_decide(held_view(waited_sec=0.1, recent_turn_sec=0.4), USAGE, LONG, CAP_1)
    assert isinstance(early, Wait) and early.cause == WaitCause.WINDOWS_FULL
    assert early.recheck_sec == pytest.approx(0.3)
    late = working_set_decide(held_view(waited_sec=0.4, recent_turn_sec=0.4), USAGE, LONG, CAP_1)
    assert late == Admit(AdmissionReason.WAIT_CAPPED, window=True, footprint=FOOTPRINT, reclaim_blocks=65)
    # behind other waiters it keeps its place: the head of the queue takes late windows first
    behind = working_set_decide(held_view(waited_sec=0.4, recent_turn_sec=0.4, waiters_ahead=2), USAGE, LONG, CAP_1)
    assert isinstance(behind, Wait) and behind.cause == WaitCause.BEHIND_WAITERS


def test_past_its_cap_a_turn_waits_on_until_late_idle_windows_make_room():
    view = held_view(
        older_window_blocks=150, late_window_blocks=20, next_late_sec=0.25, waited_sec=0.5, recent_turn_sec=0.4
    )
    decision = working_set_decide(view, USAGE, LONG, CAP_1)
    assert isinstance(decision, Wait) and decision.wake_on_release  # re-decides when a turn ends
    assert decision.recheck_sec == pytest.approx(0.25)  # ... and when the next idle window turns late
    assert "waited its cap" in decision.why
    nothing_idle = held_view(older_window_blocks=190, idle_window_blocks=0, late_window_blocks=0, waited_sec=0.5)
    decision = working_set_decide(replace(nothing_idle, recent_turn_sec=0.4), USAGE, LONG, CAP_1)
    assert isinstance(decision, Wait) and decision.wake_on_release and decision.recheck_sec is None


def test_the_late_windows_are_read_only_when_the_cap_takes_them():
    """The view reads the book's late windows through the accessor the cap calls: no
    other branch pays for the query, and nothing mirrors the cap's conditions."""
    calls = []

    def counted(**fields) -> WorkingSetView:
        view = held_view(**fields)
        late = view.late_windows
        return replace(view, late_windows=lambda: (calls.append(1), late())[1])

    for fields in (
        dict(waited_sec=0.1, recent_turn_sec=0.4),  # under its cap
        dict(waited_sec=0.4, recent_turn_sec=0.4, waiters_ahead=2),  # past it, behind others
        dict(waited_sec=0.4, recent_turn_sec=0.4, has_window=True),  # a holder
        dict(idle_window_blocks=0, older_window_blocks=0, waited_sec=9.0, recent_turn_sec=0.1),  # fits
    ):
        working_set_decide(counted(**fields), USAGE, LONG, CAP_1)
    assert calls == []
    working_set_decide(counted(waited_sec=0.4, recent_turn_sec=0.4), USAGE, LONG, CAP_1)
    assert calls, "the head of the queue past its cap reads them"


def test_a_holder_that_lost_its_window_is_capped_without_a_window_and_admissions_are_untouched():
    holder = held_view(has_window=True, older_window_blocks=150, waited_sec=1.0, recent_turn_sec=0.2)
    assert working_set_decide(holder, USAGE, LONG, CAP_1) == Admit(AdmissionReason.WAIT_CAPPED)
    # a turn that fits a window keeps getting one, however long it waited
    roomy = UsageReading(0.1, 400, 400, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01)
    fits = working_set_decide(held_view(idle_window_blocks=0, waited_sec=9.0, recent_turn_sec=0.1), roomy, LONG, CAP_1)
    assert isinstance(fits, Admit) and fits.reason == AdmissionReason.WINDOW_FITS and fits.window


def test_anonymous_turns_are_never_capped():
    decision = working_set_decide(
        WorkingSetView(anonymous=True, waited_sec=9.0, recent_turn_sec=0.1), USAGE, None, CAP_1
    )
    assert not (isinstance(decision, Admit) and decision.reason == AdmissionReason.WAIT_CAPPED)


class _Attempt:
    pass


def test_the_book_smooths_each_sessions_turn_times_and_the_replicas():
    book = SessionBook(grace=60.0)

    def turn(key, start, end):
        attempt = _Attempt()
        rec, _ = book.begin_attempt(key, attempt, start)
        book.admit(rec, attempt, "window_fits", start + 0.1, window=True, footprint=1)  # waited 0.1 s
        book.release(rec, end, attempt)
        return rec

    a = turn("a", 0.0, 1.1)  # served 1.0 s (from admission, not from the attempt's start)
    assert (a.turn_ewma, book.replica_turn_ewma) == (pytest.approx(1.0), pytest.approx(1.0))
    b = book.records.get("b")
    assert b is None
    waiting = _Attempt()
    rec, _ = book.begin_attempt("b", waiting, 2.0)
    assert book.recent_turn_sec(rec) == pytest.approx(1.0)  # no turn of its own yet: the replica's
    book.end_attempt(rec, waiting, 2.0)
    turn("a", 2.0, 2.6)  # served 0.5 s: smoothed at weight 0.5
    assert book.recent_turn_sec(a) == pytest.approx(0.75) and book.replica_turn_ewma == pytest.approx(0.75)
    # a lease released unserved (the upstream failed) teaches no turn time
    attempt = _Attempt()
    book.begin_attempt("a", attempt, 3.0)
    book.admit(a, attempt, "holds_window", 3.0, window=True)
    book.release(a, 9.0, attempt, served=False)
    assert a.turn_ewma == pytest.approx(0.75)


def turns_of_a(gate: Gate, clock, service: float) -> Any:
    """Two turns of session a, `service` seconds each, 0.3 s of tool call between them:
    its gap is 0.3 s, so its idle window is late after 0.3 s (the quiet floor is 0.2 s)
    and ends quiet after 1.2 s. Returns the second turn's lease."""

    async def run():
        first = await gate.acquire("a", "chat", {"id": "a", "messages": [{"role": "user", "content": "x" * 4000}]})
        clock.advance(service)
        first.release()
        clock.advance(0.3)
        return await gate.acquire("a", "chat", {"id": "a", "messages": [{"role": "user", "content": "x" * 4001}]})

    return run()


async def test_a_held_turn_goes_in_wait_capped_once_its_cap_runs_out(metrics, clock):
    """A window of 90 blocks on a 100-block replica holds a 50-block newcomer back (no
    block size: the work-conserving rule cannot price a hold, so it holds). The
    replica's turns took 60 ms, so at factor 2 the newcomer waits until it has waited
    120 ms; then it goes in, with a window made of the idle one, once that window's
    session is late (idle longer than its usual gap). The re-decisions run on real time
    (the cap, the time until a window turns late); the fake clock decides what they see."""
    probe = FakeProbe(usage=0.1, total=100, free=100, prefill_tokens_per_sec=1600.0)
    gate_settings = settings(policy="working_set", wait_cap_factor=2.0, late_floor_sec=0.2)
    gate = Gate("r0", probe, gate_settings, metrics, clock)
    probe.set_prefix("a", total=90, hit=0)
    lease = await turns_of_a(gate, clock, 0.06)
    clock.advance(0.06)
    lease.release()
    probe.set_prefix("b", total=50, hit=0)
    task = asyncio.create_task(
        gate.acquire("b", "chat", {"id": "b", "messages": [{"role": "user", "content": "y" * 4000}]})
    )
    await until(lambda: gate.counts()["waiters"] == 1, "the newcomer to wait")
    clock.advance(0.1)  # under its 120 ms cap: still held at its next re-decision
    calls = probe.usage_calls
    await until(lambda: probe.usage_calls > calls + 1, "the newcomer to re-decide")
    assert not task.done()
    clock.advance(0.03)  # past its cap; a, idle 0.13 s, is not late yet
    calls = probe.usage_calls
    await until(lambda: probe.usage_calls > calls, "the newcomer to re-decide past its cap")
    assert not task.done()
    assert "waited its cap" in gate.state()["sessions"]["b"]["held"]["why"]
    clock.advance(0.2)  # a is late (idle 0.33 s): b takes its window when a turns late (0.17 s of real time on)
    await until(task.done, "the cap to admit the newcomer")
    lease_b = task.result()
    assert lease_b.reason == "wait_capped"
    state = gate.state()
    assert state["windows"] == {"in_flight": ["b"], "idle": []}  # a's idle window became b's
    assert state["window_ends"]["reclaimed"] == 1 and state["sessions"]["a"]["last_window_end"] == "reclaimed"
    assert sample(metrics, "kvgate_window_ends_total", replica="r0", cause="reclaimed") == 1
    lease_b.release()
    gate.finish_session("a")
    gate.finish_session("b")
    assert_clean(gate, clock)


async def test_past_its_cap_a_turn_goes_in_once_a_window_in_flight_goes_idle_and_late(metrics, clock):
    """Past its cap, a newcomer that no late idle window makes room for waits on: woken by
    the release that leaves the in-flight window idle (the poll is a minute), it waits
    again until that window is late, then takes it."""
    probe = FakeProbe(usage=0.1, total=100, free=100, prefill_tokens_per_sec=1600.0)
    gate_settings = settings(policy="working_set", wait_cap_factor=1.0, late_floor_sec=0.2)
    gate = Gate("r0", probe, gate_settings, metrics, clock)
    probe.set_prefix("a", total=90, hit=0)
    second = await turns_of_a(gate, clock, 0.2)  # the replica's turns take 0.2 s: the newcomer's cap
    assert gate.state()["windows"]["in_flight"] == ["a"]
    probe.set_prefix("b", total=50, hit=0)
    task = asyncio.create_task(
        gate.acquire("b", "chat", {"id": "b", "messages": [{"role": "user", "content": "y" * 4000}]})
    )
    await until(lambda: gate.counts()["waiters"] == 1, "the newcomer to wait")
    calls = probe.usage_calls
    clock.advance(0.5)  # past its cap (it re-decides then, 0.2 s of real time on), but a's window is in flight
    await until(lambda: probe.usage_calls > calls, "the newcomer to re-decide past its cap")
    assert not task.done()
    held = gate.state()["sessions"]["b"]["held"]
    assert held["cause"] == "windows_full" and "waited its cap" in held["why"]
    calls = probe.usage_calls
    second.release()  # a's window goes idle: the newcomer is woken, but a is due back
    await until(lambda: probe.usage_calls > calls, "the release to wake the capped newcomer")
    assert not task.done()
    clock.advance(0.4)  # a idle past its 0.3 s gap: late
    await until(task.done, "the late window to let the capped newcomer in")
    lease_b = task.result()
    assert lease_b.reason == "wait_capped"
    assert gate.state()["windows"] == {"in_flight": ["b"], "idle": []}
    lease_b.release()
    gate.finish_session("a")
    gate.finish_session("b")
    assert_clean(gate, clock)


def test_the_book_reclaims_idle_windows_the_longest_idle_first():
    book = SessionBook(grace=60.0)

    def admit(key, at, footprint):
        attempt = _Attempt()
        rec, _ = book.begin_attempt(key, attempt, at)
        book.admit(rec, attempt, "window_fits", at, window=True, footprint=footprint)
        return rec, attempt

    a, a_turn = admit("a", 0.0, 30)
    b, _ = admit("b", 0.1, 40)  # stays in flight
    c, c_turn = admit("c", 0.2, 20)
    book.release(c, 1.0, c_turn)  # idle since 1.0
    book.release(a, 2.0, a_turn)  # idle since 2.0
    waiting = _Attempt()
    d, _ = book.begin_attempt("d", waiting, 2.2)
    # no gap measured: late after the quiet floor (0.5 s); a (idle 0.2 s) is due in 0.3 s
    assert book.late_windows(d, 2.2) == [c]
    assert book.late_window_blocks(d, 2.2) == (20, pytest.approx(0.3))
    assert book.reclaim_late_windows(d, 100, 2.2) == 20  # c alone is late
    assert (c.has_window, a.has_window, b.has_window) == (False, True, True)
    assert c.last_window_end == WindowEnd.RECLAIMED and c.is_idle  # the record stays, without its window
    assert book.reclaim_late_windows(a, 100, 3.0) == 0  # never its own, never one in flight
    assert book.reclaim_late_windows(d, 10, 3.0) == 30
    assert (book.windows_idle, book.idle_window_blocks, book.window_blocks) == (0, 0, 40)
    assert book.window_ends["reclaimed"] == 2
