"""Forwarding a held turn at low priority (`gate.held_priority`): the rule's table, and the
asyncio gate handing out a `low_priority` lease with its priority instead of a wait (leak-free)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvgate.gate.gate import Gate
from kvgate.gate.policies.low_priority import at_low_priority
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Wait, WaitCause
from kvgate.gate.policies.working_set import working_set_decide
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from tests.gate.helpers import HOLDING_PAYS, FakeProbe, assert_clean, settings, until

HELD = Wait(WaitCause.WINDOWS_FULL, "does not fit")
LOW = GateSettings(held_priority=1)
BY_PRIORITY = UsageReading(0.8, 200, 60, 16, scheduling_policy="priority")
NAMED = WorkingSetView(priority_field=True, idle_window_blocks=20, max_output_tokens=32)
FITS = PrefixReading(total_blocks=50, hit_blocks=12, hit_ratio=0.24)  # 38 new + 2 output blocks <= 60 - 20 free
TOO_BIG = PrefixReading(total_blocks=50, hit_blocks=10, hit_ratio=0.2)  # 40 + 2 > 40


@pytest.mark.parametrize(
    "view, usage, prefix, gate_settings, forwarded",
    [
        (NAMED, BY_PRIORITY, FITS, LOW, True),
        (NAMED, BY_PRIORITY, TOO_BIG, LOW, False),  # it would evict an idle window's prefix
        (NAMED, BY_PRIORITY, None, LOW, False),  # no prefix reading: no price
        (NAMED, BY_PRIORITY, FITS, GateSettings(held_priority=0), False),  # the default: held at the proxy
        (NAMED, UsageReading(0.8, 200, 60, 16, scheduling_policy="fcfs"), FITS, LOW, False),  # vLLM's default
        (NAMED, UsageReading(0.8, 200, 60, 16), FITS, LOW, False),  # a replica that does not say
        (NAMED, None, FITS, LOW, False),
        (replace(NAMED, priority_field=False), BY_PRIORITY, FITS, LOW, False),  # a route without the field
        (replace(NAMED, anonymous=True), BY_PRIORITY, FITS, LOW, False),
    ],
)
def test_a_held_turn_goes_in_low_priority_only_where_the_replica_can_run_and_yield_it(
    view, usage, prefix, gate_settings, forwarded
):
    decided = at_low_priority(HELD, view, usage, prefix, gate_settings)
    if forwarded:
        assert decided == Admit(AdmissionReason.LOW_PRIORITY, priority=1) and not decided.window
    else:
        assert decided is HELD


@pytest.mark.parametrize(
    "admit, lowered",
    [
        (Admit(AdmissionReason.WORK_CONSERVING), True),
        (Admit(AdmissionReason.WAIT_CAPPED), True),
        (Admit(AdmissionReason.WINDOW_FITS, window=True, footprint=10), False),  # window holders go as sent
        (Admit(AdmissionReason.HOLDS_WINDOW, window=True), False),
    ],
)
def test_only_turns_without_a_window_are_lowered(admit, lowered):
    decided = at_low_priority(admit, NAMED, BY_PRIORITY, FITS, LOW)
    assert decided == (replace(admit, priority=1) if lowered else admit)
    assert at_low_priority(admit, NAMED, replace(BY_PRIORITY, scheduling_policy="fcfs"), FITS, LOW) == admit


def test_the_policy_lets_in_what_it_would_hold_only_where_it_fits_the_free_room():
    """The windows' books are full (180 of 200 blocks) but vLLM has 150 free, 20 of them an
    idle window's: a 40-block newcomer is held (the work-conserving rule: re-prefill 0.061 s >
    holding 0.005 s); with held_priority it goes in at priority 2. A 110-block one would
    evict the idle window: held either way."""
    usage = UsageReading(
        0.25, 200, 150, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01, scheduling_policy="priority"
    )
    view = WorkingSetView(idle_window_blocks=20, older_window_blocks=180, max_output_tokens=1, priority_field=True)
    small = PrefixReading(total_blocks=40, hit_blocks=0, hit_ratio=0.0, total_tokens=640)
    held = working_set_decide(view, usage, small, GateSettings())
    assert isinstance(held, Wait) and held.cause == WaitCause.WINDOWS_FULL
    assert working_set_decide(view, usage, small, GateSettings(held_priority=2)) == Admit(
        AdmissionReason.LOW_PRIORITY, priority=2
    )
    big = PrefixReading(total_blocks=150, hit_blocks=10, hit_ratio=0.07, total_tokens=2400)
    assert isinstance(working_set_decide(view, usage, big, GateSettings(held_priority=2)), Wait)
    # a turn that fits a window gets one, at the body's priority
    roomy = UsageReading(0.1, 400, 400, 16, prefill_tokens_per_sec=16000.0, scheduling_policy="priority")
    fits = working_set_decide(WorkingSetView(priority_field=True), roomy, small, GateSettings(held_priority=2))
    assert isinstance(fits, Admit) and fits.reason == AdmissionReason.WINDOW_FITS and fits.priority is None


async def test_the_gate_hands_out_a_low_priority_lease_instead_of_a_wait(metrics, clock):
    """A window of 90 blocks on a 100-block replica that schedules by priority: a 50-block
    newcomer on a chat route goes in at once, `low_priority` at priority 1, without a window
    or a waiter; on the messages route (no priority field in vLLM's body) it waits."""
    probe = FakeProbe(usage=0.1, total=100, free=100, block_size=16, scheduling_policy="priority", **HOLDING_PAYS)
    gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60, held_priority=1), metrics, clock)
    probe.set_prefix("a", total=90, hit=0)
    lease_a = await gate.acquire("a", "chat", {"id": "a", "messages": [{"role": "user", "content": "x" * 4000}]})
    assert lease_a.reason == "window_fits" and lease_a.priority is None
    probe.set_prefix("b", total=50, hit=0)
    b_body = {"id": "b", "messages": [{"role": "user", "content": "y" * 4000}]}
    lease_b = await asyncio.wait_for(gate.acquire("b", "chat", b_body), 30)  # not held: no wait
    assert (lease_b.reason, lease_b.priority, lease_b.wait_ms) == ("low_priority", 1, 0.0)
    assert gate.state()["windows"]["in_flight"] == ["a"]  # b holds no window
    assert gate.counts()["waiters"] == 0
    probe.set_prefix("c", total=50, hit=0)
    held = asyncio.create_task(
        gate.acquire("c", "messages", {"id": "c", "messages": [{"role": "user", "content": "z" * 4000}]})
    )
    await until(lambda: gate.counts()["waiters"] == 1, "the messages turn to wait")
    lease_b.release()
    lease_a.release()
    gate.finish_session("a")  # a's window ends: c fits and gets one
    lease_c = await asyncio.wait_for(held, 30)
    assert lease_c.reason == "window_fits" and lease_c.priority is None
    lease_c.release()
    for key in ("b", "c"):
        gate.finish_session(key)
    assert_clean(gate, clock)
