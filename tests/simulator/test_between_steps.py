"""Both simulated engines answer the probes as vLLM's engine core does: at once while no
step runs, else at the end of the step in progress, with that step's outcome in the
answer (docs/decisions/probes-as-engine-utility-calls.md)."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.simulator.async_engine import AsyncEngine
from kvgate.simulator.config import CostModel, EngineConfig
from kvgate.simulator.request import SimRequest
from kvgate.simulator.virtual_engine import EngineStopped, SimEngine
from kvgate.simulator.virtual_loop import run_virtual

CONFIG = EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=2048)
PROMPT = list(range(1, 513))  # 512 tokens: one prefill step of 32 full blocks


def test_a_virtual_probe_during_a_step_is_answered_at_its_end_with_its_outcome():
    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine("r0", CONFIG, CostModel())
        idle = await engine.between_steps(engine.kv_answer)  # no step runs: at once
        assert loop.time() == 0.0 and idle.num_running == 0

        turn = engine.add(SimRequest("a", PROMPT, 4, CONFIG.block_size))
        await asyncio.sleep(0)  # the prefill step begins
        step_end = engine._step_began + engine._step_sec
        assert step_end > 0
        probed = SimRequest("b", PROMPT, 4, CONFIG.block_size)
        answer = await engine.between_steps(lambda: engine.prefix_answer(probed))
        assert loop.time() == step_end  # not a moment before the step ended
        assert answer.hit_blocks == 32  # the step's prefill is cached in the answer
        await turn.done
        assert len(engine._probes) == 0

    run_virtual(main())


def test_a_virtual_probe_waiting_on_a_step_fails_when_the_engine_stops():
    async def main():
        engine = SimEngine("r0", CONFIG, CostModel())
        engine.add(SimRequest("a", PROMPT, 4, CONFIG.block_size))
        await asyncio.sleep(0)
        probe = asyncio.ensure_future(engine.between_steps(engine.kv_answer))
        await asyncio.sleep(0)
        engine.stop()
        with pytest.raises(EngineStopped):
            await probe
        with pytest.raises(EngineStopped):
            await engine.between_steps(engine.kv_answer)

    run_virtual(main())


async def test_a_real_time_probe_during_a_step_sees_the_step_ended():
    engine = AsyncEngine(CONFIG, CostModel(), time_scale=5.0)  # a step of milliseconds
    engine.start()
    try:
        assert (await engine.between_steps(engine.kv_answer)).num_running == 0  # idle: at once
        handle = engine.add_request(PROMPT, 4)
        await asyncio.sleep(0)  # the prefill step begins
        assert engine.meter.observations == 0
        answer = await engine.between_steps(lambda: engine.prefix_answer(PROMPT))
        assert engine.meter.observations >= 1 and answer.hit_blocks == 32
        while not handle.finished:
            handle.changed.clear()
            await handle.changed.wait()
    finally:
        await engine.stop()
    assert len(engine._probes) == 0


async def test_a_real_time_probe_waiting_on_a_step_is_answered_when_the_engine_stops():
    engine = AsyncEngine(CONFIG, CostModel(), time_scale=1000.0)  # a step of seconds: it never ends here
    engine.start()
    engine.add_request(PROMPT, 4)
    await asyncio.sleep(0)
    probe = asyncio.ensure_future(engine.between_steps(engine.kv_answer))
    await asyncio.sleep(0)
    assert not probe.done()
    await engine.stop()
    assert (await probe).num_gpu_blocks == CONFIG.num_blocks + 1


def test_the_virtual_engine_preempts_the_newest_of_equal_priorities_as_vllm_does():
    """Under priority scheduling, ties go by arrival: each request added to a SimEngine
    takes its place in the order requests came (as `AsyncEngine.add` gives it), whatever
    arrival its maker left on it. Two requests of one priority that outgrow the cache
    together: the newest is preempted, the oldest runs through."""
    config = EngineConfig(num_blocks=10, block_size=16, max_num_batched_tokens=2048, scheduling_policy="priority")

    async def main():
        engine = SimEngine("r0", config, CostModel())
        first = SimRequest("first", list(range(1, 65)), 40, config.block_size)  # 4 blocks, growing to 7
        second = SimRequest("second", list(range(101, 165)), 40, config.block_size)
        turns = [engine.add(first), engine.add(second)]
        assert (first.arrival, second.arrival) == (0.0, 1.0)
        ends = [await turn.done for turn in turns]
        assert first.num_preemptions == 0 and second.num_preemptions >= 1
        assert ends[0] < ends[1]

    run_virtual(main())
