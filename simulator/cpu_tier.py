"""The CPU tier of a simulated engine: vLLM's native KV offloading (``--kv-offloading-size``,
its ``OffloadingConnector`` with the CPU manager and its LRU policy), one block per chunk.

What vLLM 0.32 does, and so this model (vllm/v1/kv_offload/cpu/manager.py, policies/lru.py,
distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py):

- **write-through, not write-on-evict**: a block is stored to the CPU when it is computed
  (the connector's store jobs take each step's newly full blocks), not when the GPU evicts
  it; a block the CPU already holds is not stored again and keeps its recency. A request
  that loads nothing from the CPU also offers its GPU-hit blocks (vLLM's store index then
  starts at 0): those the CPU lost are stored again;
- **LRU over blocks**: a store into a full tier evicts the least recently used blocks; a
  new block is the most recent; when a request finishes, every block it used becomes more
  recent than all others, its first block the most recent (vLLM renews their ranks in
  reverse order), so a prompt is evicted tail first;
- **lookup past the GPU hit**: the blocks right after the GPU prefix hit that the tier
  holds, in one run, are loaded instead of recomputed (vLLM's ``get_num_new_matched_tokens``);
  a lookup changes nothing.

Invariants: ``len(held) <= capacity``; every count is in engine blocks; a hash is held at
most once. Loads take ``CostModel.cpu_load_block_s`` per block (charged to the step that
admits the request: vLLM overlaps loads with other requests' compute, so this is the
pessimistic side).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class CpuTier:
    """Block hashes the CPU holds, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a CPU tier holds at least one block (got {capacity})")
        self.capacity = capacity
        self.held: OrderedDict[int, None] = OrderedDict()
        self.num_stored = 0  # blocks written to the tier since start
        self.num_evicted = 0  # blocks dropped to make room
        self.num_loaded = 0  # blocks loaded back into GPU memory

    @property
    def num_held(self) -> int:
        return len(self.held)

    def store(self, block_hashes: Iterable[int]) -> None:
        """Store the blocks not held yet, each the most recent, evicting the least recent."""
        held = self.held
        for block_hash in block_hashes:
            if block_hash in held:
                continue
            if len(held) >= self.capacity:
                held.popitem(last=False)
                self.num_evicted += 1
            held[block_hash] = None
            self.num_stored += 1

    def run(self, block_hashes: Sequence[int], start: int, stop: int) -> int:
        """How many of ``block_hashes[start:stop]`` the tier holds in one run from `start`."""
        held = self.held
        count = 0
        if start >= stop or not held:
            return 0
        for block_hash in block_hashes[start:stop]:
            if block_hash not in held:
                break
            count += 1
        return count

    def touch(self, block_hashes: Iterable[int]) -> None:
        """A request finished: its held blocks become the most recent, its first block most of all."""
        held = self.held
        for block_hash in reversed(list(block_hashes)):
            if block_hash in held:
                held.move_to_end(block_hash)
