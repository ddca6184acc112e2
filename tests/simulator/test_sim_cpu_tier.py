"""The simulated engine's CPU tier (`kvgate.simulator.cpu_tier`, vLLM's KV offloading): the
scripted sequence the plugin's probe arithmetic passes too (tests/cpu_tier_sequence.py),
over HTTP against a real `kvgate replica` server, and the engine rules the probes cannot
show: loads are charged to the step, counted apart from GPU hits, and the tier is LRU with
a finished request's blocks renewed, its first block last to go."""

from __future__ import annotations

import aiohttp
import pytest

from kvgate.simulator.config import CostModel, EngineConfig, cpu_blocks_of, cpu_load_block_seconds
from kvgate.simulator.cost_presets import get_cost_preset
from kvgate.simulator.cpu_tier import CpuTier
from kvgate.simulator.replica_server import SimulatedReplica
from kvgate.simulator.request import SimRequest
from kvgate.simulator.scheduler import Scheduler
from kvgate.wire.probe_api import KV_PATH, PREFIX_PATH, KvAnswer, PrefixAnswer
from tests.cpu_tier_sequence import run_cpu_tier_sequence

BLOCK = 16


class HttpEngine:
    """A simulated replica driven over its HTTP routes, as a gate would see it."""

    def __init__(self, url: str, http: aiohttp.ClientSession) -> None:
        self.url, self.http = url, http

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        async with self.http.request(method, self.url + path, json=body) as response:
            doc = await response.json(content_type=None)
            assert response.status == 200, f"{method} {path}: {response.status} {doc}"
            return doc

    async def serve(self, prompt: list[int]) -> None:
        body = {"model": "kvgate-sim", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        await self._json("POST", "/v1/completions", body)

    async def prefix(self, prompt: list[int]) -> PrefixAnswer:
        return PrefixAnswer.parse(await self._json("POST", PREFIX_PATH, {"token_ids": prompt}))

    async def kv(self) -> KvAnswer:
        return KvAnswer.parse(await self._json("GET", KV_PATH))


async def test_the_simulated_replica_passes_the_cpu_tier_sequence():
    replica = await SimulatedReplica.start(num_blocks=64, block_size=BLOCK, cpu_blocks=256, time_scale=0.001)
    try:
        async with aiohttp.ClientSession() as http:
            await run_cpu_tier_sequence(HttpEngine(replica.url, http))
    finally:
        await replica.stop()


async def test_without_a_tier_the_cpu_fields_are_null():
    replica = await SimulatedReplica.start(num_blocks=64, block_size=BLOCK, time_scale=0)
    try:
        async with aiohttp.ClientSession() as http:
            engine = HttpEngine(replica.url, http)
            kv = await engine.kv()
            assert (kv.num_cpu_blocks, kv.num_cpu_cached_blocks, kv.cpu_load_sec_per_block) == (None, None, None)
            assert (await engine.prefix(list(range(3, 3 + 4 * BLOCK)))).hit_blocks_cpu is None
    finally:
        await replica.stop()


def _finish(scheduler: Scheduler, request: SimRequest) -> list:
    """Step until `request` finished; the step outputs."""
    scheduler.add_request(request)
    outputs = []
    while request.request_id in scheduler.requests:
        outputs.append(scheduler.schedule())
        scheduler.update_from_output(outputs[-1], lambda r: 7)
    return outputs


def test_a_load_replaces_the_prefill_is_charged_to_the_step_and_counted_apart():
    scheduler = Scheduler(EngineConfig(num_blocks=8, block_size=4, max_model_len=32, cpu_blocks=32))
    prompt = list(range(100, 124))  # 6 blocks
    _finish(scheduler, SimRequest("a", prompt, 1, 4))
    _finish(scheduler, SimRequest("flood", list(range(500, 531)), 1, 4))  # 8 blocks: evicts "a" from the GPU
    manager = scheduler.kv_cache_manager
    assert manager.find_longest_cache_hit(SimRequest("p", prompt, 1, 4).block_hashes, 24) == []
    again = SimRequest("b", prompt + [1, 2, 3], 1, 4)  # 27 tokens: the 6 blocks are loaded, 3 tokens computed
    outputs = _finish(scheduler, again)
    assert (outputs[0].num_loaded_blocks, outputs[0].num_prefill_tokens) == (6, 3)
    assert again.num_cached_prompt_tokens == 24  # as vLLM counts an external hit
    stats = manager.prefix_cache_stats
    assert (stats.hits, stats.cpu_hits) == (0, 24)
    assert scheduler.counters.num_cpu_loaded_blocks == 6
    cost = CostModel(step_overhead_s=0.0, prefill_token_s=1.0, decode_seq_s=0.0, context_token_s=0.0)
    assert cost.step_seconds(3, 0, 0, 6) == pytest.approx(3.0 + 6 * cost.cpu_load_block_s)


def test_the_tier_is_lru_and_a_finished_request_renews_its_blocks_first_block_last_to_go():
    tier = CpuTier(4)
    tier.store([1, 2, 3])
    tier.store([2, 4])  # 2 is held: not stored again, its recency kept
    assert list(tier.held) == [1, 2, 3, 4] and tier.num_stored == 4
    tier.touch([1, 2])  # a finished request used 1 and 2: 1 is the most recent
    tier.store([5, 6])
    assert list(tier.held) == [2, 1, 5, 6] and tier.num_evicted == 2
    assert tier.run([2, 1, 9, 5], 0, 4) == 2 and tier.run([2, 1, 9, 5], 3, 4) == 1


def test_a_request_that_loads_nothing_stores_its_gpu_hits_the_tier_lost():
    scheduler = Scheduler(EngineConfig(num_blocks=16, block_size=4, max_model_len=64, cpu_blocks=4))
    prompt = list(range(100, 116))  # 4 blocks
    _finish(scheduler, SimRequest("a", prompt, 1, 4))
    _finish(scheduler, SimRequest("b", list(range(300, 316)), 1, 4))  # the tier (4 blocks) now holds only b's
    tier = scheduler.kv_cache_manager.cpu_tier
    hashes = SimRequest("p", prompt, 1, 4).block_hashes
    assert tier.run(hashes, 0, 4) == 0
    _finish(scheduler, SimRequest("c", prompt + [1], 1, 4))  # a GPU hit of 4 blocks, nothing to load
    assert tier.run(hashes, 0, 4) == 4


def test_presets_price_a_load_by_the_models_kv_bytes_over_pcie_gen5():
    assert get_cost_preset("h100-8b").cpu_load_block_s == pytest.approx(16 * 128 * 1024 / 50e9)  # ~42 us
    assert get_cost_preset("h100x2-70b").cpu_load_block_s == pytest.approx(16 * 320 * 1024 / 50e9)  # ~105 us
    _, cost = get_cost_preset("h100-8b").scaled(8)
    assert cost.cpu_load_block_s == pytest.approx(8 * 16 * 128 * 1024 / 50e9)  # a scaled block is 8 blocks
    assert cpu_load_block_seconds(128 * 1024, 16, 25) == pytest.approx(2 * 16 * 128 * 1024 / 50e9)
    assert cpu_blocks_of(4, 128 * 1024, 16) == 2048  # 4 GiB of 2 MiB blocks
