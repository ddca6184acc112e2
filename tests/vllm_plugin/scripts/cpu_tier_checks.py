"""Drive the probes' CPU tier against vLLM's real offloading manager; print JSON.

Run by the vLLM venv's python (no server, no model, no GPU): tests/vllm_plugin/test_cpu_tier.py
asserts on the printed result. vLLM's offloading needs a GPU only in its workers (the
transfers); its scheduler side is plain Python. So the script builds, with vLLM's own
classes, what a server started with an ``OffloadingConnector`` has in its scheduler:

- the real ``KVCacheManager`` (one full-attention group, 16-token blocks, 31 usable
  blocks: ``probe_side_effects.make_manager``) holding a GPU prefix;
- a real ``CPUOffloadingSpec`` (its ``num_chunks`` from ``cpu_bytes_to_use``) and the
  real ``OffloadingConnectorScheduler`` over it, whose ``CPUOffloadingManager`` (LRU)
  stores chunk keys through its own interface (``prepare_store``/``complete_store``),
  keyed as the offloading scheduler keys a request (``make_offload_key``);
- an engine core whose scheduler's connector is a ``MultiConnector``-shaped pair
  (the retention connector, the offloading connector).

Each case records the probes' answers, what vLLM's own offloading scheduler would load
after the same GPU hit (``get_num_new_matched_tokens``), and whether the probes left the
CPU manager exactly as it was.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from probe_side_effects import BLOCK_SIZE, make_manager, make_request, schedule_prefill
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvgate.vllm_plugin.engine_probes import kv_answer, prefix_answer

NUM_CPU_CHUNKS = 24
PROMPT = list(range(1000, 1000 + 10 * BLOCK_SIZE + 5))  # 10 full blocks and a partial one


def offloading_scheduler(
    kv_cache_config, blocks_per_chunk: int, num_chunks: int = NUM_CPU_CHUNKS
) -> OffloadingConnectorScheduler:
    """vLLM's scheduler side of an OffloadingConnector, as ``build_offloading_config`` would
    configure it for this KV cache (one worker, ``blocks_per_chunk`` blocks per chunk,
    `num_chunks` chunks of CPU memory)."""
    group = kv_cache_config.kv_cache_groups[0]
    bytes_per_block = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    probe = offloading_config(kv_cache_config, blocks_per_chunk, bytes_per_block, cpu_bytes=1 << 30)
    per_chunk = (1 << 30) // CPUOffloadingSpec(probe).num_chunks  # the aligned bytes of one chunk
    spec = CPUOffloadingSpec(
        offloading_config(kv_cache_config, blocks_per_chunk, bytes_per_block, cpu_bytes=per_chunk * num_chunks)
    )
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(prefix_cache_retention_interval=None, enable_prefix_caching=True),
        speculative_config=None,
        parallel_config=SimpleNamespace(world_size=1, decode_context_parallel_size=1),
    )
    return OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)


def offloading_config(kv_cache_config, blocks_per_chunk: int, bytes_per_block: int, cpu_bytes: int) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_SIZE, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": cpu_bytes},
        engine_id="kvgate-cpu-tier-checks",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_SIZE, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


class Engine:
    """An engine core with a GPU prefix cache and a CPU tier (or none)."""

    def __init__(self, blocks_per_chunk: int | None) -> None:
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.manager = make_manager()
        self.offload = (
            offloading_scheduler(self.manager.kv_cache_config, blocks_per_chunk) if blocks_per_chunk else None
        )
        retention = SimpleNamespace()  # a MultiConnector's other child (its pins are not the subject here)
        children = [retention] + ([SimpleNamespace(connector_scheduler=self.offload)] if self.offload else [])
        self.core = SimpleNamespace(
            scheduler=SimpleNamespace(
                kv_cache_manager=self.manager,
                kv_cache_config=self.manager.kv_cache_config,
                block_size=BLOCK_SIZE,
                get_request_counts=lambda: (0, 0),
                connector=SimpleNamespace(_connectors=children),
            ),
            request_block_hasher=self.hasher,
        )
        self.serial = 0

    def request(self, tokens: list[int]):
        self.serial += 1
        return make_request(f"r{self.serial}", tokens, self.hasher)

    def on_gpu(self, num_blocks: int) -> None:
        """Prefill the prompt's first `num_blocks` blocks (and one token more) and free them: cached on the GPU."""
        request = self.request(PROMPT[: num_blocks * BLOCK_SIZE + 1])
        schedule_prefill(self.manager, request)
        self.manager.free(request)

    def chunk_keys(self, chunks: list[int]) -> list[bytes]:
        """The offload keys of the prompt's chunks, as the offloading scheduler makes them."""
        per_chunk = self.offload.config.kv_group_configs[0].hashes_per_chunk
        hashes = self.request(PROMPT).block_hashes
        return [make_offload_key(hashes[per_chunk * (chunk + 1) - 1], 0) for chunk in chunks]

    def on_cpu(self, chunks: list[int], complete: bool = True) -> None:
        """Store the prompt's `chunks` through the CPU manager's own interface."""
        keys = self.chunk_keys(chunks)
        context = ReqContext(req_id=f"store-{self.serial}")
        stored = self.offload.manager.prepare_store(keys, context)
        assert stored is not None and len(stored.keys_to_store) == len(keys)
        if complete:
            self.offload.manager.complete_store(keys, context)

    def cpu_state(self) -> list:
        """Everything of the CPU manager a probe must not change (LRU ranks, counts, ref counts, events)."""
        manager = self.offload.manager
        return [
            [(key.hex(), chunk.chunk_id, chunk.ref_cnt) for key, chunk in manager._policy.chunks.items()],
            sorted((rank, key.hex()) for key, rank in manager._policy._ranks.items()),
            manager._num_allocated_chunks,
            list(manager._free_list),
            manager._num_evictable_cache_chunks,
            manager._num_write_pending_chunks,
            len(manager.events or []),
        ]

    def probes(self) -> dict:
        before = self.cpu_state() if self.offload else None
        kv, prefix = kv_answer(self.core), prefix_answer(self.core, PROMPT)
        unchanged = before is None or self.cpu_state() == before
        return {"kv": kv, "prefix": prefix, "unchanged": unchanged}

    def vllm_would_load(self, gpu_hit_tokens: int) -> int | None:
        """Tokens vLLM's own offloading scheduler would load after `gpu_hit_tokens` (None: it defers)."""
        request = self.request(PROMPT)
        self.offload.on_new_request(request)
        loaded, _ = self.offload.get_num_new_matched_tokens(request, gpu_hit_tokens)
        return loaded


def case(blocks_per_chunk: int | None, gpu_blocks: int, cpu_chunks: list[int], pending: list[int] = ()) -> dict:
    engine = Engine(blocks_per_chunk)
    engine.on_gpu(gpu_blocks)
    if engine.offload:
        engine.on_cpu(cpu_chunks)
        if pending:
            engine.on_cpu(list(pending), complete=False)
    seen = engine.probes()
    if engine.offload and not pending:
        seen["vllm_loads_tokens"] = engine.vllm_would_load(seen["prefix"]["hit_blocks"] * BLOCK_SIZE)
        seen["spec_num_chunks"] = engine.offload.manager._num_chunks
        before = engine.cpu_state()  # the snapshot does see a change: an LRU touch of the first chunk
        engine.offload.manager.touch(engine.chunk_keys(cpu_chunks[:1]), ReqContext(req_id="touch"))
        seen["snapshot_sees_a_touch"] = engine.cpu_state() != before
    return seen


def main() -> int:
    seen = {
        # one block per chunk: GPU holds blocks 0-2, the CPU 2-7 and 9 (8 is missing)
        "per_block": case(1, 3, [2, 3, 4, 5, 6, 7, 9]),
        # two blocks per chunk: GPU holds blocks 0-2, the CPU chunks 1 and 2 (blocks 2-5)
        "per_two_blocks": case(2, 3, [1, 2]),
        # the same with a chunk-aligned GPU hit of 4 blocks (the CPU run starts at chunk 2)
        "per_two_blocks_aligned": case(2, 4, [1, 2]),
        # nothing on the GPU: the run starts at block 0; a store still in flight counts as held
        "cold_gpu_pending_store": case(1, 0, [0, 1], pending=[2]),
        # the CPU holds a later run only: nothing right after the GPU hit
        "gap": case(1, 3, [5, 6]),
        # no offloading connector at all
        "no_tier": case(None, 3, []),
    }
    json.dump(seen, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
