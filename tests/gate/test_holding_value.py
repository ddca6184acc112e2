"""What holding a newcomer keeps of its own prefix (`gate/holding_value.py`), and how the
working_set policy's work-conserving rule counts the own prefix by it
(`economics.own_at_risk`): measured from the turns' usage, the whole prefix before any
measurement and while the engine has requests waiting."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgate.gate.holding_value import HOLDING_VALUE_ALPHA, HoldingValue, kept_share
from kvgate.gate.policies.economics import at_risk_blocks, own_at_risk
from kvgate.gate.policies.pricing import free_budget, usable_blocks
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Wait
from kvgate.gate.policies.working_set import working_set_decide
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from tests.gate.helpers import FakeProbe, assert_clean, body, settings

pytestmark = pytest.mark.usefixtures("loop_on_clock")


def test_kept_share_counts_the_full_blocks_of_the_previous_prompt_found_resident():
    assert kept_share(320, 400, 160, 16) == 0.5  # 10 of the 20 blocks the prompts share
    assert kept_share(320, 400, 400, 16) == 1.0  # the new tokens' hits never count above the shared blocks
    assert kept_share(320, 200, 0, 16) == 0.0  # a shorter prompt (a rewound context): its 12 blocks, none hit
    assert kept_share(None, 400, 160, 16) is None  # no previous prompt here
    assert kept_share(10, 400, 0, 16) is None  # no full block shared
    assert kept_share(320, 400, 160, None) is None


def test_the_own_share_starts_at_the_whole_prefix_and_follows_what_turns_kept():
    """Before a measurement the whole own prefix counts (the rule before it was measured).
    Where an unpinned prefix survives as well as a window's and held newcomers seldom get
    a window (the fleet), the share falls toward 0; where unpinned prefixes are gone by
    the next turn and held turns get their windows (an LRU that cycles), it stays near 1."""
    value = HoldingValue()
    assert value.own_share() == 1.0
    value.observe_next_turn(previous_window=False, kept=1.0)
    assert value.kept_without_window == pytest.approx(HOLDING_VALUE_ALPHA)  # one turn moves the prior a step
    fleet, thrash = HoldingValue(), HoldingValue()
    for _ in range(200):
        fleet.observe_next_turn(previous_window=False, kept=0.6)
        fleet.observe_next_turn(previous_window=True, kept=0.9)
        for got in (True, False, False):
            fleet.observe_held(got)
        thrash.observe_next_turn(previous_window=False, kept=0.0)
        thrash.observe_next_turn(previous_window=True, kept=1.0)
        thrash.observe_held(True)
    assert fleet.own_share() == pytest.approx(0.3 / 3, abs=0.01)
    assert thrash.own_share() == pytest.approx(1.0)
    assert fleet.state()["own_share"] == pytest.approx(0.1, abs=0.01)
    fleet.observe_next_turn(previous_window=False, kept=7.0)  # a share never leaves [0, 1]
    assert 0.0 <= fleet.kept_without_window <= 1.0
    queueing = HoldingValue(held_got_window=0.0)  # no held turn got a window: no own prefix kept ...
    for _ in range(200):
        queueing.observe_engine(probed_hit_blocks=10, hit_blocks=2)
    assert queueing.own_share() == pytest.approx(0.8, abs=1e-3)  # ... but the engine lost 8 of 10 probed blocks


def test_a_newcomer_goes_in_where_holding_keeps_little_of_its_own_prefix_unless_the_engine_queues():
    """The pinned case of test_gate_pins: 160 cold blocks behind 500 blocks of windows on
    512, a prefill-bound engine (80 ms of decode slack). Its own 160 blocks (160 ms to
    prefill again) hold it while holding keeps all of them; where holding keeps a tenth
    (16 blocks: 16 ms) it goes in work_conserving; but not while the engine has a request
    waiting: then it would wait in the engine's queue, and the whole prefix counts, as
    long as held turns get a window in the end; where a tenth of them do, a tenth of it."""
    prompt = PrefixReading(total_blocks=160, hit_blocks=0, hit_ratio=0.0, total_tokens=2560)
    view = WorkingSetView(older_window_blocks=500, idle_window_blocks=0, max_output_tokens=8, last_prompt_tokens=2400)
    usage = UsageReading(
        0.9,
        512,
        100,
        16,
        prefill_tokens_per_sec=16000.0,
        decode_step_sec=0.1,
        prefill_share=0.8,
        num_pinned_blocks=0,
        num_pinned_sessions=0,
    )
    gate_settings = GateSettings(wait_cap_factor=0.0)
    assert isinstance(working_set_decide(view, usage, prompt, gate_settings), Wait)
    little = replace(view, own_prefix_share=0.1)
    assert own_at_risk(little, usage, 160) == 16
    assert working_set_decide(little, usage, prompt, gate_settings) == Admit(AdmissionReason.WORK_CONSERVING)
    queued = replace(usage, num_waiting=1)
    assert own_at_risk(little, queued, 160) == 160
    assert isinstance(working_set_decide(little, queued, prompt, gate_settings), Wait)
    seldom = replace(little, held_got_window=0.1)
    assert own_at_risk(seldom, usage, 160) == 16
    assert own_at_risk(seldom, queued, 160) == 16
    assert working_set_decide(seldom, queued, prompt, gate_settings) == Admit(AdmissionReason.WORK_CONSERVING)
    assert own_at_risk(replace(seldom, own_prefix_share=0.5), queued, 160) == 80


async def test_the_gate_learns_from_a_turns_usage_what_it_kept_after_a_window(metrics, clock):
    """A session's second turn reports 160 cached tokens of its first turn's 320 (its usage,
    `Lease.learn`): its first turn had a window, so the replica's kept_with_window moves a
    step toward 0.5; a first turn teaches nothing (no previous prompt here)."""
    from kvgate.gate.gate import Gate

    probe = FakeProbe(usage=0.1, total=100, free=100, block_size=16)
    gate = Gate("r0", probe, settings(policy="working_set"), metrics, clock)
    first = await gate.acquire("s", "chat", body("s"))
    assert first.reason == "window_fits"
    first.learn(320, 0)
    first.release()
    assert gate.state()["holding"]["kept_with_window"] == 1.0
    second = await gate.acquire("s", "chat", body("s"))
    second.learn(400, 160)
    second.release()
    assert gate.state()["holding"]["kept_with_window"] == pytest.approx(1.0 - HOLDING_VALUE_ALPHA * 0.5)
    assert gate.state()["holding"]["kept_without_window"] == 0.0
    gate.finish_session("s")
    assert_clean(gate, clock)


async def test_a_held_turn_let_in_without_a_window_behind_others_does_not_count_against_holding(metrics, clock):
    """`held_got_window` measures whether waiting gives a newcomer a window. a holds 60 of
    100 blocks; b (50 new blocks) and c (1 block) arrive before the replica has measured
    its decode step (holding costs nothing), so both are held, c behind b. Once it has,
    c's re-prefill costs less than
    its decode slack: it goes in without a window while b still waits ahead of it, which
    says nothing of what waiting gives (counted, it would lower the measured value of
    holding and let more turns in without a window). b, let in without a window from the
    head of the queue, does count."""
    import asyncio

    from kvgate.gate.gate import Gate
    from tests.gate.helpers import until

    probe = FakeProbe(usage=0.9, total=100, free=100, block_size=16, prefill_tokens_per_sec=16000.0)
    gate = Gate("r0", probe, settings(policy="working_set", headroom_blocks=0), metrics, clock)
    probe.set_prefix("a", total=60, hit=0)
    big = "x" * 2000  # no byte bound fits 100 blocks: priced by the probe
    a = await gate.acquire("a", "chat", body("a", big, max_tokens=8))
    assert a.reason == "window_fits"
    probe.set_prefix("b", total=50, hit=0)
    probe.set_prefix("c", total=1, hit=0)
    b = asyncio.create_task(gate.acquire("b", "chat", body("b", big, max_tokens=8)))
    await until(lambda: gate.counts()["waiters"] == 1, "b to wait")
    c = asyncio.create_task(gate.acquire("c", "chat", body("c", max_tokens=8)))
    await until(lambda: gate.counts()["waiters"] == 2, "c to wait behind b")
    # measured: 8 output tokens x 0.01 s x slack 0.5, halved = 0.02 s of holding; c's one
    # block costs 1 ms to prefill again, b's fifty 50 ms (and pushes 11 of a's out)
    probe.measured = {"prefill_tokens_per_sec": 16000.0, "decode_step_sec": 0.01, "prefill_share": 0.5}
    a.release()  # the replica goes idle: every waiter decides again
    await until(c.done, "c to go in without a window")
    assert c.result().reason == "work_conserving" and not b.done()
    assert gate.state()["holding"]["held_got_window"] == 1.0
    assert _held_turns(metrics) == {"window": 0.0, "no_window": 0.0}
    probe.measured["decode_step_sec"] = 1.0  # now b's decode slack outweighs its re-prefill
    c.result().release()  # blocks freed: the head re-decides
    await until(b.done, "b to go in without a window")
    assert b.result().reason == "work_conserving"
    assert gate.state()["holding"]["held_got_window"] == pytest.approx(1.0 - HOLDING_VALUE_ALPHA)
    assert _held_turns(metrics) == {"window": 0.0, "no_window": 1.0}  # kvgate_held_turns_total counts b alone
    b.result().release()
    for session in ("a", "b", "c"):
        gate.finish_session(session)
    assert_clean(gate, clock)


def _held_turns(metrics) -> dict[str, float]:
    return {
        outcome: metrics.registry.get_sample_value("kvgate_held_turns_total", {"replica": "r0", "outcome": outcome})
        for outcome in ("window", "no_window")
    }


def test_the_windows_a_newcomer_pushes_out_count_at_the_share_of_held_turns_that_get_a_window():
    """160 cold blocks behind 500 blocks of unpinned windows on 512: admitted without a
    window it pushes 149 of the windows' blocks out (149 ms to prefill again), against
    80 ms of decode slack, its own prefix kept by holding nowhere (share 0). Held, as
    long as held turns get a window in the end. Where a quarter of them do, the rest wait
    and then go in without one, pushing the same blocks out a little later: holding saves
    a quarter of them (37 ms), and it goes in work_conserving now."""
    prompt = PrefixReading(total_blocks=160, hit_blocks=0, hit_ratio=0.0, total_tokens=2560)
    view = WorkingSetView(older_window_blocks=500, max_output_tokens=8, last_prompt_tokens=2400, own_prefix_share=0.0)
    usage = UsageReading(0.9, 512, 100, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.1, prefill_share=0.8)
    gate_settings = GateSettings(wait_cap_factor=0.0)
    budget, usable = free_budget(view, usage, gate_settings), usable_blocks(usage, gate_settings)
    assert at_risk_blocks(view, usage, prompt, gate_settings, budget, usable) == 149
    assert isinstance(working_set_decide(view, usage, prompt, gate_settings), Wait)
    seldom = replace(view, held_got_window=0.25)
    assert at_risk_blocks(seldom, usage, prompt, gate_settings, budget, usable) == 37
    assert working_set_decide(seldom, usage, prompt, gate_settings) == Admit(AdmissionReason.WORK_CONSERVING)
