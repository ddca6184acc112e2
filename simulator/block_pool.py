"""vLLM v1's block pool: KV blocks with ref counts, an LRU free queue, a prefix cache.

Invariants (as in vllm/v1/core/block_pool.py):
- a block is in the free queue iff its ref_cnt is 0;
- the free queue is in eviction order: the head is evicted first; freed blocks are
  appended at the tail (a finished request frees its blocks tail-first, so its last
  blocks are evicted before its first ones);
- a block with a hash stays in `cached_block_hash_to_block` until it is reallocated
  (evicted), so a cached block with ref_cnt 0 is still a prefix-cache hit;
- touching a cached free block takes it out of the free queue (O(1)).
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) popleft, remove, append.

    Every queued block, and each sentinel on its inner side, has both neighbours set;
    a block out of the queue has neither.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not None  # the head sentinel always has a next: a block or the tail
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None  # the tail sentinel always has a previous: a block or the head
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def popleft_many(self, count: int) -> list[KVCacheBlock]:
        """The first `count` blocks (count <= num_free_blocks), taken off at once: the blocks
        `count` poplefts would return, in that order."""
        head = self._head
        block = head.next_free
        taken = []
        for _ in range(count):
            assert block is not None and block is not self._tail, "popleft_many: not enough free blocks"
            taken.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block = following
        assert block is not None
        head.next_free = block
        block.prev_free = head
        self.num_free_blocks -= count
        return taken

    def remove_all(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`remove` each of `blocks` (all in the queue), one loop without a call per block."""
        removed = 0
        for block in blocks:
            prev, nxt = block.prev_free, block.next_free
            assert prev is not None and nxt is not None, f"{block} is not in the free queue"
            prev.next_free = nxt
            nxt.prev_free = prev
            block.prev_free = block.next_free = None
            removed += 1
        self.num_free_blocks -= removed

    def append_all(self, blocks: Iterable[KVCacheBlock]) -> None:
        """`append` each of `blocks` in order, one loop without a call per block."""
        last = self._tail.prev_free
        assert last is not None
        added = 0
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            added += 1
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += added

    def block_ids(self) -> list[int]:
        """Head-to-tail order (eviction order); for tests and debugging."""
        ids = []
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None  # the chain from the head ends at the tail
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        self.num_evictions = 0  # cached blocks whose content was dropped to reuse the block

    def get_num_free_blocks(self) -> int:
        """Free blocks, including cached blocks no live request holds (vLLM's definition)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """vLLM's KV usage: blocks held by live requests over usable blocks."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the head of the free queue, evicting their cached content."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        cached = self.cached_block_hash_to_block
        new_blocks = self.free_block_queue.popleft_many(num_blocks)
        for block in new_blocks:
            if block.block_hash is not None:
                del cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request starts using cached blocks: pin them (out of the free queue)."""
        unpinned = []
        for block in blocks:
            if block.ref_cnt == 0:
                unpinned.append(block)
            block.ref_cnt += 1
        self.free_block_queue.remove_all(unpinned)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the free queue's tail in order."""
        released = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_all(released)

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Register a full block under its hash. If another block already holds that content
        (two requests computed the same block concurrently), the first stays the cached one."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
