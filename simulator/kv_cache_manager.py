"""vLLM v1's KV cache manager for one full-attention group: per-request block tables on
top of the block pool, prefix-cache lookups, and the counters vLLM exposes.

`allocate_slots` either allocates everything a step needs for a request or nothing
(returns None), like vLLM's; the scheduler then preempts or stops admitting.
`prefix_answer` is the side-effect-free residency query behind the prefix probe
(`kvgate.wire.probe_api.PrefixAnswer`).

KV pins (`kvgate.wire.kv_pins`, the retention connector's semantics): `pins` is the
engine's `PinBook`; a pin holds one reference on each of its blocks, so pinned blocks
are neither free nor evictable. `allocate_slots` yields pins, the least recently pinned
first, before it answers None: a pin never makes a request wait or be preempted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from kvgate.simulator.block_pool import BlockPool, KVCacheBlock
from kvgate.simulator.cpu_tier import CpuTier
from kvgate.simulator.request import SimRequest
from kvgate.wire.blocks import cdiv
from kvgate.wire.pin_book import PinBook
from kvgate.wire.probe_api import PrefixAnswer

_REF_CNT = attrgetter("ref_cnt")


@dataclass
class PrefixCacheStats:
    """Token counts, as vLLM's `vllm:prefix_cache_queries`/`_hits` counters.

    Requests resuming after a preemption are counted apart (vLLM does the same), so
    the main hit rate describes first admissions only. `hits` are GPU prefix-cache hits
    (vLLM's `vllm:prefix_cache_hits`); `cpu_hits` are the tokens loaded from the CPU tier
    instead of recomputed (vLLM counts them as external hits): a token is never in both.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    cpu_hits: int = 0
    preempted_cpu_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool, num_cpu_hits: int = 0) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            self.preempted_cpu_hits += num_cpu_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits
            self.cpu_hits += num_cpu_hits


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.cpu_tier = CpuTier(cpu_blocks) if cpu_blocks else None
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.pins = PinBook()

    # -- lookups (no side effects) ---------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[int], max_length: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of `block_hashes` within `max_length` tokens."""
        # One lookup per block in C (map), then cut at the first miss: the same blocks a
        # loop that stops at the first miss finds, several times faster on long prompts.
        found = list(map(self.block_pool.cached_block_hash_to_block.get, block_hashes[: max_length // self.block_size]))
        try:
            return found[: found.index(None)]  # type: ignore[return-value]  # the prefix before the miss has no None
        except ValueError:
            return found  # type: ignore[return-value]  # no miss: every entry is a block

    def prefix_answer(self, block_hashes: Sequence[int], num_tokens: int) -> PrefixAnswer:
        """How much of a prompt of `num_tokens` tokens (its block hashes) is resident. The
        model counts a hit in whole blocks: `hit_tokens` is `hit_blocks * block_size`."""
        hits = self.find_longest_cache_hit(block_hashes, num_tokens)
        tier = self.cpu_tier
        return PrefixAnswer.of_engine(
            total_tokens=num_tokens,
            block_size=self.block_size,
            hit_block_ref_counts=list(map(_REF_CNT, hits)),
            hit_tokens=len(hits) * self.block_size,
            hit_blocks_cpu=None if tier is None else tier.run(block_hashes, len(hits), num_tokens // self.block_size),
        )

    def cpu_run(self, request: SimRequest, num_gpu_hit_blocks: int) -> int:
        """Blocks a waiting request loads from the CPU tier: the run right after its GPU hit,
        within its first num_tokens - 1 tokens (the last token is always computed)."""
        tier = self.cpu_tier
        if tier is None:
            return 0
        return tier.run(request.block_hashes, num_gpu_hit_blocks, (request.num_tokens - 1) // self.block_size)

    def get_computed_blocks(self, request: SimRequest) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks a waiting request (num_computed_tokens == 0) can reuse.

        At most num_tokens - 1 tokens hit: the last token is always computed, to get logits.
        """
        blocks = self.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        return blocks, len(blocks) * self.block_size

    # -- allocation -------------------------------------------------------------------

    def allocate_slots(
        self,
        request: SimRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones, or None if they don't fit."""
        pool = self.block_pool
        rid = request.request_id
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        num_new_blocks = cdiv(total, self.block_size) - len(req_blocks) - len(new_computed_blocks)
        if num_new_blocks <= 0 and not new_computed_blocks:
            # Fast path (most decode steps): no block to allocate, maybe one to cache.
            if total // self.block_size > self.num_cached_blocks.get(rid, 0):
                self._cache_blocks(request, total)
            return []
        num_new_blocks = max(0, num_new_blocks)
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0) if new_computed_blocks else 0
        if num_new_blocks > pool.get_num_free_blocks() - num_evictable_hits and not self._yield_pins(
            num_new_blocks, new_computed_blocks
        ):
            if not req_blocks:
                del self.req_to_blocks[rid]
            return None
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            if not req_blocks:  # the prefix-cache hits lead the table: already cached, under these hashes
                self.num_cached_blocks[rid] = len(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        self._cache_blocks(request, total)
        return new_blocks

    def _cache_blocks(self, request: SimRequest, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed (their hash is known)."""
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        cached = self.block_pool.cached_block_hash_to_block
        # BlockPool.cache_full_block's rule, inlined: this runs for every block of every
        # prompt (a prompt's hit blocks are already registered and skipped).
        for block, block_hash in zip(self.req_to_blocks[rid][start:end], request.block_hashes[start:end]):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block
        if self.cpu_tier is not None:
            self.cpu_tier.store(request.block_hashes[start:end])
        self.num_cached_blocks[rid] = end

    def touch_cpu(self, request: SimRequest) -> None:
        """A finished request renews the CPU tier's copies of its cached blocks (call before `free`)."""
        if self.cpu_tier is not None:
            self.cpu_tier.touch(request.block_hashes[: self.num_cached_blocks.get(request.request_id, 0)])

    def free(self, request: SimRequest) -> None:
        """Release a request's blocks, last block first (so it is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    # -- pins (kvgate.wire.kv_pins) -------------------------------------------------------

    def _yield_pins(self, num_new_blocks: int, new_computed_blocks: Sequence[KVCacheBlock]) -> bool:
        """Release pins, the least recently pinned first, until `num_new_blocks` fit beside
        the hits the request takes out of the free queue; False if they never do."""
        pool = self.block_pool
        while True:
            released = self.pins.yield_oldest()
            if released is None:
                return False
            self._drop_pin(released)
            evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
            if num_new_blocks <= pool.get_num_free_blocks() - evictable_hits:
                return True

    def _drop_pin(self, block_ids: list[int]) -> None:
        """Drop a pin's references, its last block first (evicted first, as a request's)."""
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks(blocks[block_id] for block_id in reversed(block_ids))

    def pin_finished(self, request: SimRequest, session: str, ttl_sec: float, now: float) -> None:
        """A finished request's session now pins its full prefix-cached blocks (the blocks a
        next turn can hit: the cached block of each of its hashes, up to the first it lacks),
        replacing the session's previous pin. Call before `free(request)`."""
        cached = self.block_pool.cached_block_hash_to_block
        hashes = request.block_hashes[: self.num_cached_blocks.get(request.request_id, 0)]
        blocks = []
        for block_hash in hashes:
            block = cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        taken, released = self.pins.pin(session, [block.block_id for block in blocks], ttl_sec, now)
        self.block_pool.touch(self.block_pool.blocks[block_id] for block_id in taken)
        self._drop_pin(released)

    def release_pins(self, sessions: Sequence[str]) -> tuple[int, int]:
        """End the pins of `sessions`: (sessions that held one, blocks they held)."""
        num_sessions = num_blocks = 0
        for session in sessions:
            if self.pins.pinned(session) is None:
                continue
            released = self.pins.release(session)
            num_sessions += 1
            num_blocks += len(released)
            self._drop_pin(released)
        return num_sessions, num_blocks

    def expire_pins(self, now: float) -> None:
        """End every pin whose ttl has passed by `now`."""
        for released in self.pins.expire(now):
            self._drop_pin(released)

    def num_held_blocks(self, request: SimRequest) -> int:
        return len(self.req_to_blocks.get(request.request_id, ()))
