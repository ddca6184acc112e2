"""The probes' CPU tier against vLLM's real offloading manager (no server, no model, no GPU).

The cases run in the vLLM venv (scripts/cpu_tier_checks.py and cpu_tier_sequence_checks.py print JSON): a real
``KVCacheManager`` holds the GPU prefix, a real ``CPUOffloadingManager`` (under vLLM's
``OffloadingConnectorScheduler``) holds chunks stored through its own interface, and the
tests assert on the probes' answers and on what vLLM's own offloading scheduler would load.
"""

from __future__ import annotations

import pytest
from vllm_harness import check_json

pytestmark = pytest.mark.vllm

BLOCK_BYTES = 2 * 2 * 32 * 4 * 16  # K and V, 2 heads of 32 float32s, 16 tokens, one layer


@pytest.fixture(scope="module")
def seen(vllm_checks: dict[str, dict]) -> dict:
    return check_json(vllm_checks, "cpu_tier_checks.py")


def test_the_cpu_run_after_the_gpu_hit_is_what_vllm_would_load(seen):
    for name in ("per_block", "per_two_blocks", "per_two_blocks_aligned", "gap"):
        case = seen[name]
        assert case["prefix"]["hit_blocks_cpu"] * 16 == case["vllm_loads_tokens"], name
    assert [seen[name]["prefix"]["hit_blocks"] for name in ("per_block", "per_two_blocks_aligned")] == [3, 4]
    # blocks 3-7 (block 2 is already on the GPU, 8 is missing); chunks of two blocks count whole
    assert [seen[name]["prefix"]["hit_blocks_cpu"] for name in ("per_block", "per_two_blocks", "gap")] == [5, 3, 0]


def test_capacity_and_held_chunks_are_counted_in_engine_blocks(seen):
    one, two = seen["per_block"]["kv"], seen["per_two_blocks"]["kv"]
    assert seen["per_block"]["spec_num_chunks"] == 24  # the spec's chunks for its cpu_bytes_to_use
    assert (one["num_cpu_blocks"], one["num_cpu_cached_blocks"]) == (24, 7)
    assert (two["num_cpu_blocks"], two["num_cpu_cached_blocks"]) == (48, 4)  # 2 blocks per chunk


def test_one_blocks_load_time_is_its_bytes_over_50_gb_per_second(seen):
    assert seen["per_block"]["kv"]["cpu_load_sec_per_block"] == pytest.approx(BLOCK_BYTES / 50e9)


def test_a_store_in_flight_counts_as_held_and_a_cold_gpu_starts_the_run_at_block_zero(seen):
    cold = seen["cold_gpu_pending_store"]
    assert (cold["prefix"]["hit_blocks"], cold["prefix"]["hit_blocks_cpu"]) == (0, 3)
    assert cold["kv"]["num_cpu_cached_blocks"] == 3


def test_the_probes_leave_the_cpu_manager_as_it_was(seen):
    assert all(case["unchanged"] for case in seen.values())
    assert seen["per_block"]["snapshot_sees_a_touch"]  # the snapshot would have seen a touch


def test_without_an_offloading_connector_the_cpu_fields_are_null(seen):
    bare = seen["no_tier"]
    assert bare["prefix"]["hit_blocks_cpu"] is None and bare["prefix"]["hit_blocks"] == 3
    assert [bare["kv"][field] for field in ("num_cpu_blocks", "num_cpu_cached_blocks", "cpu_load_sec_per_block")] == [
        None
    ] * 3


def test_vllms_real_managers_pass_the_cpu_tier_sequence_the_simulator_passes(vllm_checks: dict[str, dict]):
    """tests/cpu_tier_sequence.py against vLLM's real KV cache and offloading managers and
    the plugin's probes (scripts/cpu_tier_sequence_checks.py), chunks of one and two blocks."""
    seen = check_json(vllm_checks, "cpu_tier_sequence_checks.py")
    assert (seen["per_block"], seen["per_two_blocks"]) == ("passed", "passed"), seen
