"""Block pool and KV cache manager semantics, hand-worked on tiny pools."""

from kvgate.simulator.block_pool import FreeKVCacheBlockQueue, KVCacheBlock
from kvgate.simulator.kv_cache_manager import KVCacheManager
from kvgate.simulator.request import SimRequest, compute_block_hashes


def test_free_queue_is_fifo_with_o1_remove():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 0]
    assert queue.num_free_blocks == 3


def test_lru_eviction_order_frees_last_block_first():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    pool = manager.block_pool
    request = SimRequest("a", list(range(100, 108)), max_tokens=1, block_size=4)
    assert [b.block_id for b in manager.allocate_slots(request, 8)] == [0, 1]
    assert len(pool.cached_block_hash_to_block) == 2
    manager.free(request)
    # Freed tail-first: the request's last block is evicted before its first.
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    new = pool.get_new_blocks(3)
    assert [b.block_id for b in new] == [2, 3, 1]
    assert pool.num_evictions == 1
    first_hash = request.block_hashes[0]
    assert pool.get_cached_block(first_hash) is pool.blocks[0]
    assert pool.get_cached_block(request.block_hashes[1]) is None


def test_cached_block_with_zero_refs_is_a_hit_until_evicted():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = SimRequest("a", list(range(10)), max_tokens=1, block_size=4)
    manager.allocate_slots(first, 10)
    manager.free(first)
    again = SimRequest("b", list(range(10)), max_tokens=1, block_size=4)
    hits, hit_tokens = manager.get_computed_blocks(again)
    assert hit_tokens == 8 and [b.ref_cnt for b in hits] == [0, 0]
    manager.allocate_slots(again, 10 - hit_tokens, hits, hit_tokens)
    assert [b.ref_cnt for b in hits] == [1, 1]
    assert manager.block_pool.get_num_free_blocks() == 8 - 3


def test_last_token_is_never_a_hit():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = SimRequest("a", list(range(8)), max_tokens=1, block_size=4)
    manager.allocate_slots(first, 8)
    manager.free(first)
    again = SimRequest("b", list(range(8)), max_tokens=1, block_size=4)
    # Both blocks are cached, but the last token must be computed to produce logits.
    assert manager.get_computed_blocks(again)[1] == 4
    assert manager.prefix_answer(again.block_hashes, 8).hit_blocks == 2


def test_usage_counts_only_blocks_held_by_live_requests():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    pool = manager.block_pool
    request = SimRequest("a", list(range(16)), max_tokens=1, block_size=4)
    manager.allocate_slots(request, 16)
    assert pool.get_usage() == 0.4
    manager.free(request)
    assert pool.get_usage() == 0.0
    assert len(pool.cached_block_hash_to_block) == 4
    assert pool.get_num_free_blocks() == 10


def test_allocation_is_all_or_nothing():
    manager = KVCacheManager(num_blocks=3, block_size=4)
    request = SimRequest("a", list(range(16)), max_tokens=1, block_size=4)
    assert manager.allocate_slots(request, 16) is None
    assert manager.block_pool.get_num_free_blocks() == 3
    assert manager.num_held_blocks(request) == 0


def test_block_hashes_chain_and_salt_only_changes_first_block_key():
    tokens = list(range(12))
    plain = compute_block_hashes(tokens, 4)
    salted = compute_block_hashes(tokens, 4, cache_salt="tenant-a")
    assert len(plain) == 3 and len(set(plain)) == 3
    assert all(a != b for a, b in zip(plain, salted))  # the chain carries the salt forward
    assert compute_block_hashes(tokens[:8], 4) == plain[:2]
    assert compute_block_hashes(tokens, 4, start=1, parent=plain[0]) == plain[1:]


def test_incremental_output_hashes_match_full_hashing():
    request = SimRequest("a", list(range(6)), max_tokens=10, block_size=4, cache_salt="s")
    for token in (50, 51, 52, 53, 54, 55):
        request.append_output_token(token)
    assert request.block_hashes == compute_block_hashes(request.all_token_ids, 4, cache_salt="s")


def test_prefix_answer_reports_in_use_and_evictable_without_side_effects():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    pool = manager.block_pool
    done = SimRequest("a", list(range(8)), max_tokens=1, block_size=4)
    manager.allocate_slots(done, 8)
    manager.free(done)
    live = SimRequest("b", list(range(8)) + [90, 91, 92, 93, 94], max_tokens=1, block_size=4)
    hits, hit_tokens = manager.get_computed_blocks(live)
    manager.allocate_slots(live, live.num_tokens - hit_tokens, hits, hit_tokens)
    queue_before = pool.free_block_queue.block_ids()
    refs_before = [b.ref_cnt for b in pool.blocks]
    probe = manager.prefix_answer(live.block_hashes, live.num_tokens)
    assert (probe.total_blocks, probe.hit_blocks, probe.hit_blocks_in_use, probe.hit_blocks_evictable) == (3, 3, 3, 0)
    assert probe.hit_tokens == 12 and probe.hit_ratio == 1.0
    # No side effect: LRU order, ref counts and prefix-cache statistics are untouched.
    assert pool.free_block_queue.block_ids() == queue_before
    assert [b.ref_cnt for b in pool.blocks] == refs_before
    assert manager.prefix_cache_stats.queries == 0
    manager.free(live)
    probe = manager.prefix_answer(live.block_hashes, live.num_tokens)
    assert (probe.hit_blocks_in_use, probe.hit_blocks_evictable) == (0, 3)
