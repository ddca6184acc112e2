"""The CPU tier's pure parts (`kvgate.vllm_plugin.cpu_tier`), in the main venv (no vLLM, not
marked ``vllm``): what the plugin reads as a CPU tier, the bandwidth setting, and that a tier
it cannot read leaves the probes' fields null instead of failing them.

tests/vllm/test_cpu_tier.py runs the same arithmetic against vLLM's real offloading manager.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvgate.vllm_plugin import cpu_tier
from kvgate.vllm_plugin.engine_probes import cpu_tier_figures, hit_blocks_cpu

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
