"""The gate prices a prefix on the replica's CPU tier (vLLM's KV offloading) as a reload,
not a re-prefill: pure functions on hand-worked states, and the asyncio gate on a fake
probe answer. A reload is `cpu_load_sec_per_block` per block (the kv answer's), a
re-prefill the block's tokens at the measured prefill throughput."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.gate.gate import Gate
from kvgate.gate.policies.economics import lost_blocks_sec
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Wait, WaitCause
from kvgate.gate.policies.working_set import working_set_decide
from kvgate.gate.readings import PrefixReading, UsageReading, parse_kv_answer, parse_prefix_answer
from kvgate.gate.settings import GateSettings
from tests.gate.helpers import FakeProbe, assert_clean, body, settings, until

SETTINGS = GateSettings()
# 512 blocks of 16 tokens, 100 free; prefill 16,000 tokens/s (1 ms a block), 100 ms decode
# steps, a prefill-bound engine (80% of its time prefilling): holding a turn of 8 output
# tokens back leaves 8 x 0.1 x 0.2 / 2 = 0.08 s unused.
BASE = dict(prefill_tokens_per_sec=16000.0, decode_step_sec=0.1, prefill_share=0.8)
LOAD = 0.00002  # 20 us a block: 50x cheaper than its re-prefill


def usage(cpu_blocks: int | None = None) -> UsageReading:
    load = LOAD if cpu_blocks else None
    return UsageReading(0.9, 512, 100, 16, **BASE, num_cpu_blocks=cpu_blocks, cpu_load_sec_per_block=load)


# A newcomer's 160-block prompt, all new (100 free): its window fits the books (300 blocks
# in older windows) but not vLLM's free blocks, so the work-conserving rule weighs it: it
# pushes no window out, but its own 160 blocks are unprotected without a window.
VIEW = WorkingSetView(older_window_blocks=300, idle_window_blocks=0, max_output_tokens=8, last_prompt_tokens=2400)


def prompt(hit_cpu: int) -> PrefixReading:
    return PrefixReading(total_blocks=160, hit_blocks=0, hit_ratio=0.0, total_tokens=2560, hit_blocks_cpu=hit_cpu)


def test_lost_blocks_are_reloaded_where_the_tier_holds_them_and_recomputed_elsewhere():
    assert lost_blocks_sec(100, usage()) == pytest.approx(0.1)  # no tier: 100 re-prefills of 1 ms
    small = usage(cpu_blocks=256)  # smaller than the GPU: only blocks seen on it reload
    assert not small.tier_holds_evictions
    assert lost_blocks_sec(100, small) == pytest.approx(0.1)
    assert lost_blocks_sec(100, small, reloadable=40) == pytest.approx(0.06 + 40 * LOAD)
    large = usage(cpu_blocks=2048)  # 4x the GPU: it holds whatever the GPU evicts
    assert large.tier_holds_evictions
    assert lost_blocks_sec(100, large) == pytest.approx(100 * LOAD)
    assert lost_blocks_sec(100, UsageReading(0.9, 512, 100, 16, num_cpu_blocks=2048)) is None  # no load time
    assert lost_blocks_sec(100, UsageReading(0.9, 512, 100, 16)) is None  # nothing measured


def test_a_turn_whose_prefix_is_on_the_cpu_goes_in_where_its_re_prefill_would_hold_it():
    held = working_set_decide(VIEW, usage(), prompt(0), SETTINGS)
    assert isinstance(held, Wait) and held.cause == WaitCause.NO_FREE_BLOCKS
    assert "re-prefill 0.160s > holding cost 0.080s" in held.why
    # the same prompt, its 160 blocks on a small CPU tier: a reload of 3.2 ms
    assert working_set_decide(VIEW, usage(256), prompt(160), SETTINGS) == Admit(AdmissionReason.WORK_CONSERVING)
    # half of it on the CPU: 80 re-prefills (80 ms) + 80 loads > 80 ms: still held
    assert isinstance(working_set_decide(VIEW, usage(256), prompt(80), SETTINGS), Wait)
    # a tier of 4x the GPU holds what it evicts: no prefix on the CPU yet, still a reload
    assert working_set_decide(VIEW, usage(2048), prompt(0), SETTINGS) == Admit(AdmissionReason.WORK_CONSERVING)


def test_the_probe_answers_carry_the_cpu_tier_into_the_readings():
    kv = {"kv_cache_usage": 0.5, "num_total_blocks": 512, "num_free_blocks": 256, "block_size": 16}
    reading = parse_kv_answer({**kv, "num_cpu_blocks": 2048, "cpu_load_sec_per_block": LOAD})
    assert (reading.num_cpu_blocks, reading.cpu_load_sec_per_block) == (2048, LOAD)
    assert (parse_kv_answer(kv).num_cpu_blocks, parse_kv_answer(kv).cpu_load_sec_per_block) == (None, None)
    answer = {"total_blocks": 10, "hit_blocks": 2, "hit_ratio": 0.2, "total_tokens": 160, "block_size": 16}
    assert parse_prefix_answer({**answer, "hit_blocks_cpu": 5}).hit_blocks_cpu == 5
    assert parse_prefix_answer(answer).hit_blocks_cpu == 0


@pytest.mark.usefixtures("loop_on_clock")
@pytest.mark.parametrize("on_cpu", [False, True])
async def test_the_gate_admits_a_turn_whose_prefix_reloads_cheaper_than_it_waits(metrics, clock, on_cpu):
    """A replica of 100 blocks, all free: "a" holds an idle window of 61 blocks; "b", 60
    blocks of prompt, does not fit beside it. Holding it leaves 8 decode steps of 20 ms at
    the engine's idle half unused (40 ms). Without its prefix on the CPU its admission costs
    82 re-prefills (22 blocks of a's window and its own 60: 82 ms): held until "a" ends. On
    the CPU (a tier smaller than the GPU) its own 60 reload: 22 ms + 1.2 ms, admitted at
    once, without a window."""
    cpu = {"num_cpu_blocks": 50, "cpu_load_sec_per_block": LOAD}
    measured = dict(prefill_tokens_per_sec=16000.0, decode_step_sec=0.02, prefill_share=0.5, **cpu)
    probe = FakeProbe(usage=0.1, total=100, free=100, block_size=16, **measured)
    gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60), metrics, clock)
    probe.set_prefix("a", total=60, hit=0, tokens=960)
    first = await gate.acquire("a", "chat", body("a", "x" * 4000, max_tokens=8))  # too long to skip the probe
    assert first.reason == "window_fits"
    first.release()
    probe.set_prefix("b", total=60, hit=0, tokens=960, hit_cpu=60 if on_cpu else 0)
    task = asyncio.create_task(gate.acquire("b", "chat", body("b", "x" * 4000, max_tokens=8)))
    if on_cpu:
        await until(task.done, "b admitted")
        assert task.result().reason == "work_conserving"
    else:
        await until(lambda: gate.counts()["waiters"] == 1, "b held")
        assert gate.state()["sessions"]["b"]["held"]["cause"] == "windows_full"
        gate.finish_session("a")
        await until(task.done, "b admitted once a's window ends")
    task.result().release()
    gate.finish_session("a")
    gate.finish_session("b")
    assert_clean(gate, clock)
