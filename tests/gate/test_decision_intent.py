"""The shell obeys the decision's fields and infers nothing from its reason.

A scripted policy hands the gate exactly the decision a test sets, so each field is
seen doing its one job: `wake_next` (and not the reason) wakes the next waiter,
`reprice_above` (and not how the price was reached) sends the prefix probe beside the
turn, `window` / `footprint` open, renew, price and end windows, `drop_window` loses
one. Every test ends with nothing left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvgate.gate.gate import Gate
from kvgate.gate.policies.pricing import window_footprint
from kvgate.gate.policies.registry import Policy
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Decision, Wait, WaitCause
from tests.gate.helpers import FakeProbe, assert_clean, body, settings, settle, until

# Logic tests: the gate's timers run on the fake clock (see conftest.loop_on_clock).
pytestmark = pytest.mark.usefixtures("loop_on_clock")

HELD = Wait(WaitCause.COLD_PREFIX, "scripted")


def scripted(decide: Callable[[], Decision]) -> Policy[WorkingSetView]:
    """A policy that answers `decide()` and never asks for a prefix probe; it reprices a
    window priced at a bound as the working_set policy does."""
    return Policy("scripted", WorkingSetView.read, lambda *_: decide(), price=window_footprint, reads_prompt_bound=True)


class Script:
    """A policy whose decision the test sets."""

    def __init__(self) -> None:
        self.decision: Decision = HELD

    def policy(self) -> Policy[WorkingSetView]:
        return scripted(lambda: self.decision)


def make_gate(script: Script, probe, metrics, clock) -> Gate:
    # no poll within a test: a waiter re-decides only when the shell wakes it
    return Gate("r0", probe, settings(wait_poll_sec=60), metrics, clock, script.policy())


async def test_wake_next_wakes_the_next_waiter_whatever_the_reason(probe, metrics, clock):
    script = Script()
    gate = make_gate(script, probe, metrics, clock)
    held = asyncio.ensure_future(gate.acquire("held", "chat", body("held")))
    await until(lambda: gate.counts()["waiters"] == 1, "the waiter")
    script.decision = Admit(AdmissionReason.OPEN)  # `open`, but no wake_next: nobody is woken
    quiet = await gate.acquire("a", "chat", body("a"))
    await settle()
    assert not held.done()
    script.decision = Admit(AdmissionReason.WINDOW_FITS, wake_next=True)  # any reason with wake_next wakes
    loud = await gate.acquire("b", "chat", body("b"))
    woken = await held
    assert woken.reason == "window_fits" and gate.counts()["waiters"] == 0
    for lease in (quiet, loud, woken):
        lease.release()
    assert_clean(gate, clock)


async def test_reprice_above_sends_the_prefix_probe_once_the_windows_pass_it(metrics, clock):
    probe = FakeProbe(usage=0.1, total=100, free=100, block_size=16)
    probe.set_prefix("b", total=2, hit=0, tokens=40)  # exact: ceil(40 / 16) = 3 blocks
    script = Script()
    gate = make_gate(script, probe, metrics, clock)
    script.decision = Admit(AdmissionReason.WINDOW_FITS, window=True, footprint=30, reprice_above=40)
    first = await gate.acquire("a", "chat", body("a"))  # 30 blocks in windows: not above 40
    await settle()
    assert probe.prefix_calls == []
    second = await gate.acquire("b", "chat", body("b"))  # 60 > 40: b gets its exact price
    await until(lambda: gate.state()["sessions"]["b"]["resident_blocks"] == 3, "b re-priced")
    assert probe.prefix_calls == ["b"]
    script.decision = Admit(AdmissionReason.WINDOW_FITS, window=True, footprint=30)  # an exact price: final
    third = await gate.acquire("c", "chat", body("c"))
    await settle()
    assert probe.prefix_calls == ["b"] and gate.state()["sessions"]["c"]["resident_blocks"] == 30
    for lease in (first, second, third):
        lease.release()
    assert_clean(gate, clock)


async def test_window_footprint_and_drop_window_are_booked_as_decided(probe, metrics, clock):
    script = Script()
    gate = make_gate(script, probe, metrics, clock)
    script.decision = Admit(AdmissionReason.HOLDS_WINDOW, window=True, footprint=12)
    lease = await gate.acquire("s", "chat", body("s"))
    assert gate.state()["windows"]["in_flight"] == ["s"] and gate.state()["window_blocks"] == 12
    lease.release()
    script.decision = Admit(AdmissionReason.HOLDS_WINDOW, window=True)  # renewed at its last footprint
    lease = await gate.acquire("s", "chat", body("s"))
    assert gate.state()["window_blocks"] == 12
    lease.release()
    script.decision = Admit(AdmissionReason.WORK_CONSERVING)  # no window: the one it held ends
    lease = await gate.acquire("s", "chat", body("s"))
    state = gate.state()
    assert state["windows"] == {"in_flight": [], "idle": []} and state["window_ends"]["revoked"] == 1
    lease.release()
    script.decision = Admit(AdmissionReason.WINDOW_FITS, window=True, footprint=5)
    lease = await gate.acquire("s", "chat", body("s"))
    lease.release()
    script.decision = Wait(WaitCause.WINDOW_LOST, "scripted", drop_window=True)
    waiter = asyncio.ensure_future(gate.acquire("s", "chat", body("s")))
    await until(lambda: gate.counts()["waiters"] == 1, "the waiter")
    state = gate.state()
    assert state["window_ends"]["lost"] == 1 and state["sessions"]["s"]["windows_lost"] == 1
    assert state["window_blocks"] == 0 and state["pending"] == ["s"]
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert_clean(gate, clock)


async def test_wake_on_release_wakes_a_waiter_behind_the_head_when_blocks_are_freed(probe, metrics, clock):
    """A release wakes the head waiter and, of those behind it, only one whose Wait asked
    for it (`wake_on_release`); the other re-decides at its poll (60 s here)."""
    decisions: list[Decision] = [
        Admit(AdmissionReason.WINDOW_FITS),  # running
        HELD,  # head
        HELD,  # plain
        Wait(WaitCause.BEHIND_WAITERS, "scripted", wake_on_release=True),  # eager
        HELD,  # after the release: the head, woken first, stays held
        Admit(AdmissionReason.WORK_CONSERVING),  # eager goes in
    ]
    policy = scripted(lambda: decisions.pop(0) if decisions else HELD)
    gate = Gate("r0", probe, settings(wait_poll_sec=60), metrics, clock, policy)
    running = await gate.acquire("running", "chat", body("running"))
    head = asyncio.ensure_future(gate.acquire("head", "chat", body("head")))
    await until(lambda: gate.counts()["waiters"] == 1, "the head waiter")
    plain = asyncio.ensure_future(gate.acquire("plain", "chat", body("plain")))
    await until(lambda: gate.counts()["waiters"] == 2, "a plain waiter behind it")
    eager = asyncio.ensure_future(gate.acquire("eager", "chat", body("eager")))
    await until(lambda: gate.counts()["waiters"] == 3, "a waiter that asked to be woken on release")
    running.release()  # blocks freed
    await until(eager.done, "the eager waiter to be admitted")  # without the wake: its 60 s poll, never here
    eager_lease = eager.result()
    await settle()
    assert not head.done() and not plain.done() and gate.counts()["waiters"] == 2
    for waiter in (head, plain):
        waiter.cancel()
    eager_lease.release()
    await settle()
    assert_clean(gate, clock)
