"""Engine-side probes against vLLM's real KVCacheManager and BlockPool (no server, no model).

The measurements run in the vLLM venv (scripts/probe_side_effects.py prints JSON);
these tests assert on them.
"""

from __future__ import annotations

import pytest
from vllm_harness import check_json

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def side_effects(vllm_checks: dict[str, dict]) -> dict:
    return check_json(vllm_checks, "probe_side_effects.py")


def test_probes_change_no_lru_order_ref_count_hash_map_stats_or_events(side_effects):
    assert side_effects["changed_by_probes"] == []


def test_the_snapshot_detects_a_real_touch(side_effects):
    # Guards the test above: a touch (what the scheduler does on a hit) is visible.
    assert {"free_queue", "ref_cnts"} <= set(side_effects["changed_by_touch"])


def test_resident_evictable_prompt_counts_every_full_block(side_effects):
    probe = side_effects["probes"]["a"]
    assert (probe["total_tokens"], probe["total_blocks"], probe["hit_blocks"]) == (83, 5, 5)
    assert probe["hit_ratio"] == 1.0
    assert (probe["hit_blocks_in_use"], probe["hit_blocks_evictable"]) == (0, 5)


def test_hit_tokens_equal_the_schedulers_own_lookup(side_effects):
    assert side_effects["probes"]["a"]["hit_tokens"] == side_effects["scheduler_hit_tokens_a"] == 80


def test_running_request_blocks_count_as_in_use_and_last_block_is_recomputed(side_effects):
    probe = side_effects["probes"]["b"]  # 64 tokens, exactly 4 blocks, request still running
    assert (probe["hit_blocks"], probe["hit_blocks_in_use"], probe["hit_blocks_evictable"]) == (4, 4, 0)
    assert probe["hit_tokens"] == 48  # vLLM recomputes the last token, so the last block


def test_shared_prefix_hits_only_the_shared_blocks(side_effects):
    probe = side_effects["probes"]["a_extended"]
    assert (probe["hit_blocks"], probe["total_blocks"]) == (3, 5)
    assert probe["hit_ratio"] == pytest.approx(0.6)


def test_cache_salt_and_lora_change_the_hashes(side_effects):
    assert side_effects["probes"]["a_salted"]["hit_blocks"] == 0
    assert side_effects["probes"]["a_lora"]["hit_blocks"] == 0


def test_unseen_and_sub_block_prompts_hit_nothing(side_effects):
    assert side_effects["probes"]["unseen"]["hit_blocks"] == 0
    short = side_effects["probes"]["short"]
    assert (short["total_blocks"], short["hit_ratio"]) == (0, 0.0)


def test_kv_usage_reads_the_block_pool(side_effects):
    kv = side_effects["probes"]["kv"]
    assert kv["num_gpu_blocks"] == 32 and kv["num_total_blocks"] == 31  # minus the null block
    assert kv["num_free_blocks"] == 27  # B's 4 blocks are held; A's 5 are free (evictable)
    assert kv["num_cached_blocks"] == 9
    assert kv["kv_cache_usage"] == pytest.approx(4 / 31)
    assert (kv["num_running"], kv["num_waiting"], kv["block_size"]) == (1, 0, 16)


def test_install_is_idempotent(side_effects):
    assert side_effects["install"] == [True, False, True]
