"""The CPU tier's pure parts (`kvgate.vllm_plugin.cpu_tier`), in the main venv (no vLLM, not
marked ``vllm``): what the plugin reads as a CPU tier, the bandwidth setting, and that a tier
it cannot read leaves the probes' fields null instead of failing them.

tests/vllm_plugin/test_cpu_tier.py runs the same arithmetic against vLLM's real offloading manager;
here it also passes the scripted sequence the simulated engine's tier passes
(tests/cpu_tier_sequence.py), over a stand-in of vLLM's engine with offloading on.
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest

from kvgate.vllm_plugin import cpu_tier
from kvgate.vllm_plugin.engine_probes import cpu_tier_figures, hit_blocks_cpu
from kvgate.wire.probe_api import KvAnswer, PrefixAnswer
from tests.cpu_tier_sequence import run_cpu_tier_sequence

BLOCK = 16


class Manager:
    """vLLM's CPUOffloadingManager as `cpu_tier` reads it; keys are (hash, group)."""

    def __init__(self, held: set[int], num_chunks: int = 10) -> None:
        self.held = held
        self._num_chunks, self._num_allocated_chunks, self._free_list = num_chunks, len(held) + 2, [0, 1]
        self.lookups = 0

    def lookup(self, key, req_context):
        self.lookups += 1
        return SimpleNamespace(name="HIT" if key[0] in self.held else "MISS")


def engine(manager, blocks_per_chunk: int = 1, groups: int = 1, wrap_in_tiering: bool = False, page: int = 4096):
    group = SimpleNamespace(
        group_idx=0,
        tokens_per_block=BLOCK,
        tokens_per_chunk=BLOCK * blocks_per_chunk,
        hashes_per_chunk=blocks_per_chunk,
    )
    side = SimpleNamespace(
        manager=SimpleNamespace(primary_tier=manager) if wrap_in_tiering else manager,
        config=SimpleNamespace(kv_group_configs=[group] * groups),
    )
    spec = SimpleNamespace(page_size_bytes=page)
    return SimpleNamespace(
        scheduler=SimpleNamespace(
            block_size=BLOCK,
            connector=SimpleNamespace(connector_scheduler=side),
            kv_cache_config=SimpleNamespace(
                kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["a"] * 4)]
            ),
        )
    )


def run(core, hashes: int, gpu_hit: int) -> int:
    return cpu_tier.cpu_run_blocks(cpu_tier.cpu_tier_of(core), list(range(hashes)), gpu_hit, lambda h, g: (h, g), None)


def test_the_run_starts_at_the_chunk_holding_the_first_block_past_the_gpu_hit():
    manager = Manager(held={3, 5, 7})  # chunks of 2 blocks keyed by their last hash: blocks 2-7 held
    core = engine(manager, blocks_per_chunk=2)
    assert [run(core, 10, gpu_hit) for gpu_hit in (0, 2, 3, 4, 8)] == [0, 6, 5, 4, 0]
    assert run(core, 7, 2) == 4, "the last chunk of the prompt is whole or not looked up"


def test_capacity_and_held_are_in_engine_blocks_and_the_load_time_follows_the_bandwidth():
    core = engine(Manager(held={1, 2, 3}), blocks_per_chunk=2)
    figures = cpu_tier.capacity_figures(cpu_tier.cpu_tier_of(core), env={})
    assert (figures["num_cpu_blocks"], figures["num_cpu_cached_blocks"]) == (20, 6)  # 3 chunks held of 10
    assert figures["cpu_load_sec_per_block"] == pytest.approx(4 * 4096 / 50e9)  # 4 layers of 4 KiB pages
    slower = cpu_tier.capacity_figures(cpu_tier.cpu_tier_of(core), env={cpu_tier.BANDWIDTH_ENV: "25"})
    assert slower["cpu_load_sec_per_block"] == pytest.approx(2 * figures["cpu_load_sec_per_block"])
    for bad in ("fast", "0", "-3"):
        assert cpu_tier.load_bandwidth({cpu_tier.BANDWIDTH_ENV: bad}) == 50e9, bad


def test_an_8b_models_block_loads_in_about_42_microseconds_at_pcie_gen5():
    # 128 KiB of KV per token, 16-token blocks: 2 MiB a block over 50 GB/s
    assert cpu_tier.load_sec_per_block(128 * 1024 * 16, cpu_tier.load_bandwidth({})) == pytest.approx(
        41.94e-6, rel=1e-3
    )


def test_a_tiering_managers_primary_cpu_tier_is_read():
    core = engine(Manager(held={0, 1}), wrap_in_tiering=True)
    assert run(core, 4, 0) == 2


def test_no_tier_a_hybrid_model_or_a_missing_internal_leave_the_fields_null():
    assert cpu_tier.cpu_tier_of(SimpleNamespace(scheduler=SimpleNamespace(connector=None))) is None
    assert cpu_tier.cpu_tier_of(engine(Manager(held={0}), groups=2)) is None  # several offloaded groups
    unreadable = engine(SimpleNamespace(lookup=lambda key, context: None))  # no chunk counters
    assert cpu_tier.cpu_tier_of(unreadable) is None
    assert cpu_tier_figures(unreadable) == {} and hit_blocks_cpu(unreadable, [b"h"], 0) is None
    broken = engine(Manager(held={0}))
    del broken.scheduler.block_size  # a vLLM that renamed it: null fields, not a failed probe
    assert cpu_tier_figures(broken) == {}
    unknown_size = engine(Manager(held={0}), page=0)
    assert cpu_tier_figures(unknown_size)["cpu_load_sec_per_block"] is None


class ChunkLru:
    """vLLM's ``CPUOffloadingManager`` with its LRU policy as the plugin reads it (``lookup``,
    the chunk pool's counters) and as the offloading scheduler drives it: write-through
    stores of chunks keyed by (last block hash, group), the least recently used evicted and
    its chunk id reused, a finished request's chunks renewed with its first the most recent."""

    def __init__(self, num_chunks: int) -> None:
        self._num_chunks, self._num_allocated_chunks, self._free_list = num_chunks, 0, []
        self.chunks: OrderedDict = OrderedDict()  # key -> chunk id, least recent first

    def lookup(self, key, req_context):
        return SimpleNamespace(name="HIT" if key in self.chunks else "MISS")

    def store(self, keys) -> None:
        for key in keys:
            if key in self.chunks:
                continue
            if len(self.chunks) >= self._num_chunks:
                self._free_list.append(self.chunks.popitem(last=False)[1])
            if self._free_list:
                chunk = self._free_list.pop()
            else:
                chunk, self._num_allocated_chunks = self._num_allocated_chunks, self._num_allocated_chunks + 1
            self.chunks[key] = chunk

    def touch(self, keys) -> None:
        for key in reversed(keys):
            if key in self.chunks:
                self.chunks.move_to_end(key)


class StandInEngine:
    """A vLLM engine with offloading on, as a `TierEngine` (tests/cpu_tier_sequence.py): a GPU prefix
    cache (LRU, a finished prompt freed tail first), `ChunkLru` behind the offloading
    scheduler, and probe answers made by the plugin's arithmetic (`cpu_tier`)."""

    def __init__(self, gpu_blocks: int, cpu_blocks: int, blocks_per_chunk: int) -> None:
        self.gpu_blocks, self.per_chunk = gpu_blocks, blocks_per_chunk
        self.manager = ChunkLru(cpu_blocks // blocks_per_chunk)
        self.core = engine(self.manager, blocks_per_chunk=blocks_per_chunk)
        self.gpu: OrderedDict = OrderedDict()  # block hash -> None, evicted first first

    @staticmethod
    def hashes(prompt: list[int]) -> list[bytes]:
        return [repr(prompt[: end + BLOCK]).encode() for end in range(0, len(prompt) - BLOCK + 1, BLOCK)]

    def keys(self, hashes: list[bytes]) -> list:
        return [(hashes[i + self.per_chunk - 1], 0) for i in range(0, len(hashes) - self.per_chunk + 1, self.per_chunk)]

    def gpu_hit(self, hashes: list[bytes]) -> int:
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.gpu:
            hit += 1
        return hit

    async def serve(self, prompt: list[int]) -> None:
        hashes = self.hashes(prompt)
        for block_hash in hashes:  # the prompt's own blocks are in use: not evicted for it
            self.gpu.pop(block_hash, None)
        while len(self.gpu) + len(hashes) > self.gpu_blocks:
            self.gpu.popitem(last=False)
        self.manager.store(self.keys(hashes))  # write-through: every computed (or loaded) chunk
        for block_hash in reversed(hashes):
            self.gpu[block_hash] = None
        self.manager.touch(self.keys(hashes))

    async def prefix(self, prompt: list[int]) -> PrefixAnswer:
        hashes = self.hashes(prompt)
        hit = self.gpu_hit(hashes)
        tier = cpu_tier.cpu_tier_of(self.core)
        cpu = cpu_tier.cpu_run_blocks(tier, hashes, hit, lambda h, g: (h, g), None)
        return PrefixAnswer.of_engine(
            total_tokens=len(prompt),
            block_size=BLOCK,
            hit_block_ref_counts=[0] * hit,
            hit_tokens=min(hit * BLOCK, len(prompt) - 1),
            hit_blocks_cpu=cpu,
        )

    async def kv(self) -> KvAnswer:
        return KvAnswer.of_engine(
            num_gpu_blocks=self.gpu_blocks + 1,
            num_free_blocks=self.gpu_blocks,
            num_cached_blocks=len(self.gpu),
            block_size=BLOCK,
            num_running=0,
            num_waiting=0,
            **cpu_tier.capacity_figures(cpu_tier.cpu_tier_of(self.core), env={}),
        )


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
async def test_the_plugins_probe_arithmetic_passes_the_cpu_tier_sequence(blocks_per_chunk):
    await run_cpu_tier_sequence(StandInEngine(gpu_blocks=64, cpu_blocks=256, blocks_per_chunk=blocks_per_chunk))
