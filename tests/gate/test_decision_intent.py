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

from kvgate.gate.errors import AdmissionTimeout
from kvgate.gate.gate import Gate
from kvgate.gate.policies.pricing import window_footprint
from kvgate.gate.policies.registry import Policy
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Decision, Reject, RejectCode, Wait, WaitCause
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
    await until(lambda: gate.state()["sessions"]["b"]["footprint_blocks"] == 3, "b re-priced")
    assert probe.prefix_calls == ["b"]
    script.decision = Admit(AdmissionReason.WINDOW_FITS, window=True, footprint=30)  # an exact price: final
    third = await gate.acquire("c", "chat", body("c"))
    await settle()
    assert probe.prefix_calls == ["b"] and gate.state()["sessions"]["c"]["footprint_blocks"] == 30
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
    assert state["window_blocks"] == 0 and state["waiters"] == ["s"]
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert_clean(gate, clock)


async def test_wake_on_release_wakes_a_waiter_behind_the_head_when_blocks_are_freed(probe, metrics, clock):
    """A release wakes the head waiter and, of those behind it, only one whose Wait asked
    for it (`wake_on_release`); the other re-decides at its poll (60 s here)."""
    decisions: list[Decision] = [
        Admit(AdmissionReason.WINDOW_FITS),  # running
        Admit(AdmissionReason.WINDOW_FITS),  # another turn in flight: the release leaves the replica busy
        HELD,  # head
        HELD,  # plain
        Wait(WaitCause.BEHIND_WAITERS, "scripted", wake_on_release=True),  # eager
        HELD,  # after the release: the head, woken first, stays held
        Admit(AdmissionReason.WORK_CONSERVING),  # eager goes in
    ]
    policy = scripted(lambda: decisions.pop(0) if decisions else HELD)
    gate = Gate("r0", probe, settings(wait_poll_sec=60), metrics, clock, policy)
    running = await gate.acquire("running", "chat", body("running"))
    busy = await gate.acquire("busy", "chat", body("busy"))
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
    busy.release()
    await settle()
    assert_clean(gate, clock)


class Decider:
    """A scripted policy that answers per session (`by_session`, else HELD) and counts
    each session's decisions: who the shell woke, and when."""

    def __init__(self) -> None:
        self.by_session: dict[str, Decision] = {}
        self.calls: dict[str, int] = {}

    def policy(self, sessions: list[str]) -> Policy[WorkingSetView]:
        # The view does not carry the session: each acquire tags its body, read back here.
        def decide(view: WorkingSetView, *_: object) -> Decision:
            session = sessions[view.max_output_tokens]
            self.calls[session] = self.calls.get(session, 0) + 1
            return self.by_session.get(session, HELD)

        return Policy("scripted", WorkingSetView.read, decide)


UNPOLLED = Wait(WaitCause.BEHIND_WAITERS, "scripted", poll=False)
SESSIONS = ["busy", "head", "behind", "last"]


def tagged(session: str) -> dict:
    return body(session, max_tokens=SESSIONS.index(session))  # the scripted policy reads it back


async def _queue_of_three(
    decider: Decider, probe, metrics, clock, poll: float = 60.0, behind: Wait = UNPOLLED, head_ahead_sec: float = 0.0
):
    """`busy` in flight, then `head` (HELD), `behind` (`behind`) and `last` (UNPOLLED)
    waiting; the head joins `head_ahead_sec` before the others (with a max_wait_sec of 5 s)."""
    max_wait = {"max_wait_sec": 5.0} if head_ahead_sec else {}
    gate = Gate("r0", probe, settings(wait_poll_sec=poll, **max_wait), metrics, clock, decider.policy(SESSIONS))
    decider.by_session = {"busy": Admit(AdmissionReason.OPEN), "behind": behind, "last": UNPOLLED}
    busy = await gate.acquire("busy", "chat", tagged("busy"))
    tasks = {}
    for count, session in enumerate(("head", "behind", "last"), start=1):
        tasks[session] = asyncio.ensure_future(gate.acquire(session, "chat", tagged(session)))
        await until(lambda count=count: gate.counts()["waiters"] == count, f"{session} to wait")
        if session == "head" and head_ahead_sec:
            clock.advance(head_ahead_sec)
            await settle()
    return gate, busy, tasks


async def test_only_the_head_and_polled_waiters_poll(probe, metrics, clock):
    """The head re-decides every wait_poll_sec; a waiter behind it whose Wait said
    `poll=False` does not (only the head leaving, freed blocks it asked for, or an idle
    replica can change its decision)."""
    decider = Decider()
    gate, busy, tasks = await _queue_of_three(decider, probe, metrics, clock, poll=1.0)
    before = dict(decider.calls)
    for _ in range(3):
        clock.advance(1.0)
        await settle()
    assert decider.calls["head"] == before["head"] + 3
    assert decider.calls["behind"] == before["behind"] and decider.calls["last"] == before["last"]
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    busy.release()
    assert_clean(gate, clock)


@pytest.mark.parametrize("how", ["admitted", "cancelled", "superseded", "rejected", "timed_out"])
async def test_an_unpolled_waiter_is_woken_when_it_heads_the_queue_and_then_polls(how, probe, metrics, clock):
    """However the head leaves, the waiter behind it is woken at once (no poll ever would),
    re-decides, and, heading the queue now, polls; the one behind it still does not. A
    re-sent head keeps its session's place: it heads the queue again, and polls."""
    decider = Decider()
    ahead = 2.0 if how == "timed_out" else 0.0  # the head reaches max_wait_sec first
    gate, busy, tasks = await _queue_of_three(decider, probe, metrics, clock, poll=1.0, head_ahead_sec=ahead)
    before = dict(decider.calls)
    head_lease = None
    if how == "admitted":
        decider.by_session["head"] = Admit(AdmissionReason.WINDOW_FITS)
        clock.advance(1.0)  # the head's poll admits it
        head_lease = await tasks["head"]
    elif how == "cancelled":
        tasks["head"].cancel()
    elif how == "superseded":
        again = asyncio.ensure_future(gate.acquire("head", "chat", tagged("head")))  # the same turn, re-sent
    elif how == "rejected":
        decider.by_session["head"] = Reject(RejectCode.PROMPT_TOO_LONG, "scripted")
        clock.advance(1.0)
    else:
        clock.advance(3.0)  # past the head's max_wait_sec, not the others'
        with pytest.raises(AdmissionTimeout):
            await tasks["head"]
    await until(lambda: decider.calls["behind"] > before["behind"], "the new head to re-decide")
    assert decider.calls["last"] == before["last"]
    new_head = "behind"
    if how == "superseded":  # the re-sent turn keeps its session's place: it heads the queue again
        await until(lambda: gate.counts()["waiters"] == 3, "the re-sent turn to wait")
        assert [waiter["session"] for waiter in gate.waiters()] == ["head", "behind", "last"]
        new_head = "head"
    calls = decider.calls[new_head]
    clock.advance(1.0)  # the new head polls (`last` does not)
    await until(lambda: decider.calls[new_head] == calls + 1, "the new head's poll")
    assert decider.calls["last"] == before["last"]
    pending = [t for t in tasks.values() if not t.done()] + ([again] if how == "superseded" else [])
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks.values(), *pending, return_exceptions=True)
    for lease in (head_lease, busy):
        if lease is not None:
            lease.release()
    assert_clean(gate, clock)


async def test_the_replica_going_idle_wakes_every_waiter(probe, metrics, clock):
    """The release of the last lease out wakes every waiter, unpolled ones included (an
    idle replica changes what holding a turn costs); a release that leaves one out wakes
    the head only."""
    decider = Decider()
    gate, busy, tasks = await _queue_of_three(decider, probe, metrics, clock)
    decider.by_session["busy"] = Admit(AdmissionReason.OPEN)
    other = await gate.acquire("busy", "chat", tagged("busy"))  # a second turn in flight
    before = dict(decider.calls)
    other.release()
    await settle()
    assert decider.calls["head"] == before["head"] + 1
    assert decider.calls["behind"] == before["behind"] and decider.calls["last"] == before["last"]
    busy.release()  # the last lease: the replica is idle
    await until(lambda: decider.calls["last"] == before["last"] + 1, "every waiter to re-decide")
    assert decider.calls["behind"] == before["behind"] + 1 and decider.calls["head"] == before["head"] + 2
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert_clean(gate, clock)


@pytest.mark.parametrize("behind_polls", [True, False])
async def test_each_release_wakes_the_next_waiter_not_awake_but_passes_over_unpolled_ones(
    behind_polls, probe, metrics, clock
):
    """Two releases at once wake two waiters in arrival order (the head, then the next);
    a waiter whose Wait said `poll=False` is passed over (its place did not change)."""
    decider = Decider()
    gate, busy, tasks = await _queue_of_three(decider, probe, metrics, clock, behind=HELD if behind_polls else UNPOLLED)
    others = [await gate.acquire("busy", "chat", tagged("busy")) for _ in range(2)]
    before = dict(decider.calls)
    for lease in others:  # both before any waiter runs: the second finds the head awake
        lease.release()
    await settle()
    assert decider.calls["head"] == before["head"] + 1
    assert decider.calls["behind"] == before["behind"] + (1 if behind_polls else 0)
    assert decider.calls["last"] == before["last"]
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    busy.release()
    assert_clean(gate, clock)
