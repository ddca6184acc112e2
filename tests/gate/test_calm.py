"""The calm rule (`Policy.calm`): a named turn with no waiter at the gate whose upper bound
fits is admitted from a few O(1) facts, without the policy's full view (the twenty facts,
the queue walk, the ranking of windows) or its decision table; and wherever it answers,
it answers what the full decision would. A turn admitted alone never computes its key
(a digest of its prompt): the book names it only when another attempt of the session
acquires beside it.

Fake clock, fake probe: the same random histories run through a gate whose policy has
the calm rule and one whose policy has none, and every outcome and the books after each
step must match.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

import kvgate.gate.gate as gate_module
from kvgate.gate.book import SessionBook
from kvgate.gate.errors import AdmissionError
from kvgate.gate.gate import Gate, Lease
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.policies.registry import WORKING_SET
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.working_set import working_set_decide
from tests.gate.helpers import HOLDING_PAYS, FakeClock, FakeProbe, assert_clean, body, settings

pytestmark = pytest.mark.usefixtures("loop_on_clock")


class Calls:
    """How often the spy policy's full view, full decision and calm rule ran."""

    def __init__(self) -> None:
        self.view = self.decide = self.calm = 0


def spy_policy(calls: Calls):
    """The working_set policy, counting its calls."""

    def view(facts):
        calls.view += 1
        return WorkingSetView.read(facts)

    def decide(view, usage, prefix, gate_settings):
        calls.decide += 1
        return working_set_decide(view, usage, prefix, gate_settings)

    def calm(view, usage, gate_settings):
        calls.calm += 1
        assert WORKING_SET.calm is not None
        return WORKING_SET.calm(view, usage, gate_settings)

    return replace(WORKING_SET, view=view, decide=decide, calm=calm)


async def test_a_calm_turn_builds_no_view_and_reads_no_decision_table(
    metrics: GateMetrics, clock: FakeClock, monkeypatch
):
    calls = Calls()
    probe = FakeProbe(usage=0.02, total=1000, free=980, block_size=16)
    gate = Gate("r0", probe, settings(), metrics, clock, policy=spy_policy(calls))
    attempts_booked = []
    real_begin = SessionBook.begin_attempt
    monkeypatch.setattr(
        SessionBook,
        "begin_attempt",
        lambda book, key, *rest, **named: attempts_booked.append(key) or real_begin(book, key, *rest, **named),
    )
    for turn in range(3):  # a newcomer's window, then the holder's renewals
        lease = await gate.acquire("s", "chat", body("s", "hello " * (turn + 1), max_tokens=16))
        assert lease.reason == ("window_fits" if turn == 0 else "holds_window")
        lease.learn(8 + turn, 0)
        lease.release()
    assert (calls.calm, calls.view, calls.decide) == (3, 0, 0)
    assert probe.prefix_calls == []
    # the calm path: each turn booked with its admission, no attempt ever acquiring, no usage awaited
    assert attempts_booked == [] and probe.newer_than == [None, None, None]
    # Pressure: the turn's bound no longer fits vLLM's free blocks, so the calm rule gives
    # way and the full decision (a prefix probe, then the table) decides it: it waits.
    probe.free = 1
    waiter = asyncio.ensure_future(gate.acquire("t", "chat", body("t", max_tokens=16)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiter.done() and gate.counts()["waiters"] == 1
    assert calls.view >= 1 and calls.decide >= 1
    assert probe.prefix_calls == ["t"] and attempts_booked == ["t"]
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert_clean(gate, clock)


async def test_a_waiter_at_the_gate_turns_the_calm_rule_off(metrics: GateMetrics, clock: FakeClock):
    """With a turn queued, a newcomer may be behind it: every turn is decided in full."""
    calls = Calls()
    probe = FakeProbe(usage=0.02, total=100, free=100, block_size=16, **HOLDING_PAYS)
    gate = Gate("r0", probe, settings(), metrics, clock, policy=spy_policy(calls))
    probe.set_prefix("big", total=90, hit=0, tokens=90 * 16)
    held = await gate.acquire("big", "chat", body("big", "x" * 2000))  # probed: its bound is over 100 blocks
    probe.set_prefix("next", total=20, hit=0, tokens=20 * 16)
    waiter = asyncio.ensure_future(gate.acquire("next", "chat", body("next", "x" * 2000)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert gate.counts()["waiters"] == 1
    calm_before = calls.calm
    # its bound fits, but a waiter is queued ahead of it: decided in full (it waits behind)
    behind = asyncio.ensure_future(gate.acquire("small", "chat", body("small")))
    for _ in range(20):
        await asyncio.sleep(0)
    assert calls.calm == calm_before
    assert not behind.done() and gate.counts()["waiters"] == 2
    for task in (behind, waiter):
        task.cancel()
    await asyncio.gather(behind, waiter, return_exceptions=True)
    held.release()
    assert_clean(gate, clock)


# ------------------------------------------------------------- same answers, same books


SESSIONS = ("a", "b", "c", "d", "e")


class Side:
    """One gate of the comparison, with its own probe and leases (the clock is shared)."""

    def __init__(self, policy, clock: FakeClock, at_once: bool = True) -> None:
        self.clock = clock
        self.probe = FakeProbe(usage=0.3, total=200, free=200, block_size=16, max_model_len=4096, max_token_bytes=8)
        if not at_once:  # a probe that cannot tell its reading without waiting: no calm path
            self.probe.ready_usage = None  # type: ignore[assignment,method-assign]
        gate_settings = settings(quiet_floor_sec=0.5, wait_cap_factor=2.0)
        self.gate = Gate("r0", self.probe, gate_settings, GateMetrics(CollectorRegistry()), clock, policy=policy)
        self.leases: dict[str, Lease] = {}
        self.waiting: dict[str, asyncio.Task] = {}


def _harvest(side: Side) -> list[tuple[str, object]]:
    """The waiters a wake-up has admitted or refused since the last step: their outcomes."""
    outcomes: list[tuple[str, object]] = []
    for session, task in sorted(side.waiting.items()):
        if task.done():
            del side.waiting[session]
            refusal = task.exception()
            if refusal is None:
                side.leases[session] = task.result()
                outcomes.append((session, side.leases[session].reason))
            else:
                outcomes.append((session, getattr(refusal, "code", repr(refusal))))
    return outcomes


async def _settle() -> None:
    """Run every task that is ready (both gates share the loop) until none is."""
    for _ in range(50):
        await asyncio.sleep(0)


async def _step(side: Side, op: tuple) -> object:
    """Carry out one operation of a history on `side`; what it came to."""
    kind, session, arg = op
    if kind == "turn":
        if session in side.leases or session in side.waiting:
            return "busy"
        side.probe.set_prefix(session, total=arg // 16 + 1, hit=(arg // 32), tokens=arg)
        task = asyncio.ensure_future(side.gate.acquire(session, "chat", body(session, "w" * arg, max_tokens=32)))
        for _ in range(10):
            await asyncio.sleep(0)
        if not task.done():
            side.waiting[session] = task
            return "waits"
        try:
            lease = task.result()
        except AdmissionError as refusal:
            return refusal.code
        side.leases[session] = lease
        return lease.reason
    if kind == "end" and session in side.leases:
        lease = side.leases.pop(session)
        lease.learn(arg, arg // 2)
        lease.release()
        return "released"
    if kind == "cancel" and session in side.waiting:
        task = side.waiting.pop(session)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return "cancelled"
    if kind == "free":
        side.probe.free = arg
        return "free"
    return "nothing"


def _history(rng: random.Random) -> list[tuple]:
    ops = []
    for _ in range(120):
        kind = rng.choice(("turn", "turn", "turn", "end", "end", "cancel", "free", "clock"))
        session = rng.choice(SESSIONS)
        if kind == "free":
            arg = rng.choice((200, 200, 150, 60, 10))
        elif kind == "clock":
            arg = rng.randint(1, 300)
        else:
            arg = rng.choice((40, 300, 900, 1600, 2500))
        ops.append((kind, session, arg))
    return ops


@pytest.mark.parametrize("calm_path", [True, False], ids=["calm-path", "calm-rule-booked"])
@pytest.mark.parametrize("seed", range(12))
async def test_the_calm_rule_decides_as_the_full_decision_on_random_histories(
    seed: int, calm_path: bool, clock: FakeClock
):
    """With the calm path (a turn the calm rule admits is booked with its admission) and
    without it (its attempt booked first, as every turn the full decision decides), the
    outcomes and the books equal the full decision's."""
    calm = Side(WORKING_SET, clock, at_once=calm_path)
    full = Side(replace(WORKING_SET, calm=None), clock)
    outcomes = []
    for op in _history(random.Random(seed)):
        if op[0] == "clock":  # one clock for both gates (and the loop's timers)
            clock.advance(op[2] / 100)
            await _settle()  # the waiters it wakes on both gates re-decide before the next step
            assert _harvest(calm) == _harvest(full), op
            continue
        outcome = await _step(calm, op)
        assert outcome == await _step(full, op), op
        await _settle()
        assert _harvest(calm) == _harvest(full), op
        assert calm.gate.state() == full.gate.state(), op
        outcomes.append(outcome)
    # the histories reach both calm admissions and decisions under pressure
    assert {"window_fits", "holds_window"} <= set(outcomes)
    for side in (calm, full):
        for task in side.waiting.values():
            task.cancel()
        await asyncio.gather(*side.waiting.values(), return_exceptions=True)
        for lease in side.leases.values():
            lease.release()
    assert_clean(calm.gate, clock)
    assert full.gate.counts() == calm.gate.counts()


# ------------------------------------------------------------ a lone turn is not named


class Names:
    """A turn's naming function that counts its calls."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, 0

    def __call__(self) -> str:
        self.calls += 1
        return self.name


def test_a_lone_attempt_is_admitted_without_its_turn_ever_being_named():
    book = SessionBook(60.0)
    for turn in range(3):
        names, attempt = Names(f"t{turn}"), object()
        rec, previous = book.begin_attempt("s", attempt, float(turn), names)
        book.admit(rec, attempt, "window_fits", float(turn), window=True, footprint=1)
        book.release(rec, float(turn) + 0.5, attempt)
        assert names.calls == 0 and previous is None
    assert rec.attempts == {} and rec.unnamed_turn is None  # nothing of the turn's body is kept


def test_a_second_attempt_names_the_first_and_supersedes_it_only_on_the_same_turn():
    book = SessionBook(60.0)
    first, second, third = object(), object(), object()
    first_name = Names("main")
    rec, previous = book.begin_attempt("s", first, 0.0, first_name)
    assert previous is None and first_name.calls == 0
    rec, previous = book.begin_attempt("s", second, 0.1, Names("title"))  # a distinct turn beside it
    assert previous is None and first_name.calls == 1
    assert rec.attempts == {"main": first, "title": second} and rec.unnamed_turn is None
    rec, previous = book.begin_attempt("s", third, 0.2, Names("main"))  # the first turn re-sent
    assert previous is first and rec.num_superseded == 1
    assert rec.attempts == {"main": third, "title": second}
    for attempt in (second, third):
        book.end_attempt(rec, attempt, 0.3)
    assert rec.attempts == {}


async def test_the_gate_digests_a_turn_only_when_another_of_its_session_acquires(
    metrics: GateMetrics, clock: FakeClock, monkeypatch
):
    digests: list[str] = []
    real_turn_key = gate_module.turn_key

    def counting(route_kind, turn_body):
        digests.append(turn_body["id"])
        return real_turn_key(route_kind, turn_body)

    monkeypatch.setattr(gate_module, "turn_key", counting)
    probe = FakeProbe(usage=0.02, total=1000, free=980, block_size=16)
    gate = Gate("r0", probe, settings(), metrics, clock)
    for _ in range(3):
        lease = await gate.acquire("s", "chat", body("s"))
        lease.release()
    assert digests == []
    probe.hold = asyncio.Event()  # the next attempt stops in its usage probe, still acquiring
    first = asyncio.ensure_future(gate.acquire("s", "chat", body("s", "again")))
    for _ in range(5):
        await asyncio.sleep(0)
    resent = asyncio.ensure_future(gate.acquire("s", "chat", body("s", "again")))  # the same turn re-sent
    for _ in range(5):
        await asyncio.sleep(0)
    assert digests == ["s", "s"]  # the waiting attempt named, then the newcomer
    probe.hold.set()
    lease = await resent
    with pytest.raises(AdmissionError):
        await first
    lease.release()
    assert_clean(gate, clock)
