"""The one scripted sequence every engine with a CPU tier (vLLM's KV offloading) must pass,
as its probes report it (`wire.probe_api`: `hit_blocks_cpu`, `num_cpu_blocks`,
`num_cpu_cached_blocks`, `cpu_load_sec_per_block`).

Run against the simulated replica over HTTP (tests/simulator/test_sim_cpu_tier.py) and
against the plugin's probe arithmetic (`vllm_plugin.cpu_tier`) over a stand-in of vLLM's
offloading manager (tests/vllm_plugin/test_cpu_tier_logic.py), with the same steps and the
same assertions: that ties the simulator's tier to what the plugin reports. Prompts are
token ids, so block counts are exact on both.

The engine must be otherwise idle, have prefix caching on, a CPU tier of at least three
times its GPU blocks, an empty tier at the start, and serve prompts of up to
`num_total_blocks - 1` blocks.
"""

from __future__ import annotations

import random
from typing import Protocol

from kvgate.wire.probe_api import KvAnswer, PrefixAnswer

TOKEN_RANGE = (3, 900)  # ids every test vocabulary has (as tests/pin_sequence.py)


class TierEngine(Protocol):
    """An engine under test: serve a prompt to completion, answer the two probes."""

    async def serve(self, prompt: list[int]) -> None: ...

    async def prefix(self, prompt: list[int]) -> PrefixAnswer: ...

    async def kv(self) -> KvAnswer: ...


def prompt_of(seed: int, num_blocks: int, block_size: int) -> list[int]:
    """A prompt of exactly `num_blocks` full blocks, distinct for each seed."""
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(num_blocks * block_size)]


async def run_cpu_tier_sequence(engine: TierEngine) -> None:
    """Every step of the CPU tier's semantics as the probes show them, asserting each."""
    kv = await engine.kv()
    assert kv.num_total_blocks and kv.block_size and kv.num_cpu_blocks, f"no GPU or CPU block counts: {kv}"
    assert kv.num_cpu_cached_blocks == 0, f"the CPU tier is not empty at the start: {kv}"
    assert kv.cpu_load_sec_per_block and kv.cpu_load_sec_per_block > 0, f"no load time: {kv}"
    gpu, cpu, size = kv.num_total_blocks, kv.num_cpu_blocks, kv.block_size
    assert cpu >= 3 * gpu, f"the sequence needs a CPU tier of at least 3x the GPU blocks: {kv}"
    window = 2 * max(1, gpu // 8)  # even: whole chunks of two blocks
    prompt = prompt_of(1, window, size)
    await _stored_when_computed(engine, prompt, window)
    await _evicted_from_the_gpu_it_is_on_the_cpu(engine, prompt, window, gpu, size)
    await _loaded_back(engine, prompt, window, size)
    await _the_tier_evicts_when_full(engine, prompt, gpu, cpu, size)


async def _stored_when_computed(engine: TierEngine, prompt: list[int], window: int) -> None:
    """A served prompt is on the GPU and already stored to the CPU (write-through); the probe
    counts the GPU hit, and no CPU run after it."""
    await engine.serve(prompt)
    answer = await engine.prefix(prompt)
    assert (answer.hit_blocks, answer.hit_blocks_cpu) == (window, 0), answer
    kv = await engine.kv()
    assert (kv.num_cpu_cached_blocks or 0) >= window, f"the computed blocks were not stored: {kv}"


async def _evicted_from_the_gpu_it_is_on_the_cpu(
    engine: TierEngine, prompt: list[int], window: int, gpu: int, size: int
) -> None:
    """Once other prompts evict it from the GPU, its blocks are reported in `hit_blocks_cpu`,
    not in the GPU hit; the run stops at the first block the CPU lacks."""
    flood = max(2, gpu // 4)
    for seed in range(100, 106):  # 1.5x the GPU: every earlier block evicted from it
        await engine.serve(prompt_of(seed, flood, size))
    answer = await engine.prefix(prompt)
    assert (answer.hit_blocks, answer.hit_blocks_cpu) == (0, window), answer
    longer = await engine.prefix(prompt + prompt_of(2, 2, size))
    assert (longer.hit_blocks, longer.hit_blocks_cpu, longer.total_blocks) == (0, window, window + 2), longer
    kv = await engine.kv()
    assert (kv.num_cpu_cached_blocks or 0) <= (kv.num_cpu_blocks or 0), kv


async def _loaded_back(engine: TierEngine, prompt: list[int], window: int, size: int) -> None:
    """Serving it again loads the CPU run back: the GPU holds it whole afterwards."""
    longer = prompt + prompt_of(3, 2, size)
    await engine.serve(longer)
    answer = await engine.prefix(longer)
    assert (answer.hit_blocks, answer.hit_blocks_cpu) == (window + 2, 0), answer


async def _the_tier_evicts_when_full(engine: TierEngine, prompt: list[int], gpu: int, cpu: int, size: int) -> None:
    """Prompts of more than both tiers together push the prompt out of both; the tier is full."""
    flood = max(2, gpu // 4)
    for seed in range(200, 200 + 2 + (cpu + gpu) // flood):
        await engine.serve(prompt_of(seed, flood, size))
    answer = await engine.prefix(prompt)
    assert (answer.hit_blocks, answer.hit_blocks_cpu) == (0, 0), answer
    kv = await engine.kv()
    assert kv.num_cpu_cached_blocks == kv.num_cpu_blocks, f"a flooded tier is full: {kv}"
