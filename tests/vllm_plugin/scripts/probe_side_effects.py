"""Run the engine-side probes against vLLM's real KVCacheManager/BlockPool; print JSON.

Run by the vLLM venv's python (no server, no model): tests/vllm_plugin/test_engine_probes.py
asserts on the printed result. The script builds a real ``KVCacheManager`` (one
full-attention group, 16-token blocks, stats and KV events on), drives it the way
the scheduler does (``get_computed_blocks`` + ``allocate_slots``, ``free``), and
then snapshots everything a probe must not change: the free queue's LRU order,
every block's ref count and hash, the block-hash map, the prefix-cache stats and
the KV event queue. It runs the probes, snapshots again, and also shows the
snapshot does detect a change (a ``touch``), so "unchanged" is a real finding.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvgate.vllm_plugin.engine_plugin import KV_ANSWER_METHOD, PREFIX_ANSWER_METHOD, install_probes
from kvgate.vllm_plugin.engine_probes import kv_answer, prefix_answer

BLOCK_SIZE = 16
NUM_BLOCKS = 32


def make_manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=NUM_BLOCKS * BLOCK_SIZE,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
        log_stats=True,
        enable_kv_cache_events=True,
    )


def make_request(request_id: str, token_ids: list[int], hasher, cache_salt: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=hasher,
    )


def schedule_prefill(manager: KVCacheManager, request: Request) -> int:
    """What the scheduler does for a new request: look up hits, allocate, compute."""
    computed_blocks, num_computed, _ = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_computed
    blocks = manager.allocate_slots(request, num_new, num_computed, computed_blocks)
    assert blocks is not None, "test cache too small"
    request.num_computed_tokens = request.num_tokens
    manager.record_prefix_cache_stats(request, num_computed)
    return num_computed


def free_queue_order(block_pool) -> list[int]:
    queue = block_pool.free_block_queue
    order, block = [], queue.fake_free_list_head.next_free_block
    while block is not None and block is not queue.fake_free_list_tail:
        order.append(block.block_id)
        block = block.next_free_block
    return order


def snapshot(manager: KVCacheManager) -> dict:
    pool = manager.block_pool
    stats = manager.prefix_cache_stats
    return {
        "free_queue": free_queue_order(pool),
        "num_free": pool.get_num_free_blocks(),
        "ref_cnts": [block.ref_cnt for block in pool.blocks],
        "block_hashes": [repr(block.block_hash) for block in pool.blocks],
        "hash_map": sorted(
            (repr(key), sorted(v.block_id for v in (value.values() if isinstance(value, dict) else [value])))
            for key, value in pool.cached_block_hash_to_block._cache.items()
        ),
        "stats": [stats.requests, stats.queries, stats.hits, stats.preempted_requests],
        "kv_events": len(pool.kv_event_queue),
    }


def main() -> int:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    manager = make_manager()
    engine_core = SimpleNamespace(
        scheduler=SimpleNamespace(kv_cache_manager=manager, block_size=BLOCK_SIZE, get_request_counts=lambda: (1, 0)),
        request_block_hasher=hasher,
    )

    prompt_a = list(range(1000, 1000 + 5 * BLOCK_SIZE + 3))  # 5 full blocks
    prompt_b = list(range(3000, 3000 + 4 * BLOCK_SIZE))  # 4 full blocks, block-aligned
    request_a = make_request("a", prompt_a, hasher)
    schedule_prefill(manager, request_a)
    manager.free(request_a)  # A's blocks are now cached and evictable
    request_b = make_request("b", prompt_b, hasher)
    schedule_prefill(manager, request_b)  # B stays running: its blocks are in use

    before = snapshot(manager)
    probes = {
        "a": prefix_answer(engine_core, prompt_a),
        "a_extended": prefix_answer(engine_core, prompt_a[: 3 * BLOCK_SIZE] + [7] * 40),
        "a_salted": prefix_answer(engine_core, prompt_a, cache_salt="tenant-1"),
        "a_lora": prefix_answer(engine_core, prompt_a, lora={"lora_name": "x", "lora_int_id": 1, "lora_path": "/x"}),
        "b": prefix_answer(engine_core, prompt_b),
        "unseen": prefix_answer(engine_core, list(range(9000, 9100))),
        "short": prefix_answer(engine_core, [1, 2, 3]),
        "kv": kv_answer(engine_core),
    }
    for _ in range(20):
        prefix_answer(engine_core, prompt_a)
        kv_answer(engine_core)
    after = snapshot(manager)

    # What the scheduler would actually reuse for A right now, through its own path.
    request_a2 = make_request("a2", prompt_a, hasher)
    _, scheduler_hit_tokens, _ = manager.get_computed_blocks(request_a2)

    # Control: the snapshot does see an LRU change.
    manager.block_pool.touch(manager.get_computed_blocks(make_request("a3", prompt_a, hasher))[0].blocks[0])
    touched = snapshot(manager)

    class Probe:
        pass

    first_install = install_probes(Probe)
    second_install = install_probes(Probe)
    has_methods = hasattr(Probe, KV_ANSWER_METHOD) and hasattr(Probe, PREFIX_ANSWER_METHOD)

    changed = sorted(key for key in before if before[key] != after[key])
    control_changed = sorted(key for key in after if after[key] != touched[key])
    print(
        json.dumps(
            {
                "probes": probes,
                "changed_by_probes": changed,
                "changed_by_touch": control_changed,
                "scheduler_hit_tokens_a": scheduler_hit_tokens,
                "install": [first_install, second_install, has_methods],
                "before_stats": before["stats"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
