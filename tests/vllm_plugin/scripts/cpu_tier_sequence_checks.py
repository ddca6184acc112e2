"""Run the scripted CPU-tier sequence (tests/cpu_tier_sequence.py) against vLLM's real
managers and the plugin's real probes; print JSON.

Run by the vLLM venv's python (no server, no model, no GPU): tests/vllm_plugin/test_cpu_tier.py
asserts on the printed result. The engine is cpu_tier_checks.py's: vLLM's real
``KVCacheManager`` (31 usable blocks) and ``OffloadingConnectorScheduler`` with its
``CPUOffloadingManager`` (LRU), driven as vLLM's scheduler and offloading connector drive
them for one request: its prefill allocated and computed (a GPU hit reused), its chunks
stored write-through (``prepare_store``/``complete_store``: held chunks stay, the least
recently used make room), renewed when it finishes (``touch``, its first chunk the most
recent), its blocks freed. The probes are the plugin's ``kv_answer``/``prefix_answer``.
The simulator's tier passes the same sequence (tests/simulator/test_sim_cpu_tier.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from cpu_tier_checks import Engine, offloading_scheduler  # scripts/ is on sys.path
from probe_side_effects import BLOCK_SIZE, NUM_BLOCKS, schedule_prefill
from vllm.v1.kv_offload.base import ReqContext, make_offload_key

from kvgate.vllm_plugin.engine_probes import kv_answer, prefix_answer
from kvgate.wire.probe_api import KvAnswer, PrefixAnswer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.cpu_tier_sequence
from tests.cpu_tier_sequence import run_cpu_tier_sequence  # noqa: E402

CPU_BLOCKS = 4 * (NUM_BLOCKS - 1)  # the sequence needs at least 3x the GPU's usable blocks


class SequenceEngine(Engine):
    """cpu_tier_checks' engine, serving whole prompts as a `TierEngine`."""

    def __init__(self, blocks_per_chunk: int) -> None:
        super().__init__(None)
        self.offload = offloading_scheduler(
            self.manager.kv_cache_config, blocks_per_chunk, CPU_BLOCKS // blocks_per_chunk
        )
        self.core.scheduler.connector._connectors.append(SimpleNamespace(connector_scheduler=self.offload))
        self.per_chunk = blocks_per_chunk

    async def serve(self, prompt: list[int]) -> None:
        request = self.request(prompt)
        schedule_prefill(self.manager, request)
        hashes = request.block_hashes
        keys = [
            make_offload_key(hashes[i + self.per_chunk - 1], 0)
            for i in range(0, len(hashes) - self.per_chunk + 1, self.per_chunk)
        ]
        context = ReqContext(req_id=request.request_id)
        stored = self.offload.manager.prepare_store(keys, context)
        assert stored is not None, "the CPU manager could not make room"
        self.offload.manager.complete_store(stored.keys_to_store, context)
        self.offload.manager.touch(keys, context)
        self.manager.free(request)

    async def prefix(self, prompt: list[int]) -> PrefixAnswer:
        return PrefixAnswer.parse(prefix_answer(self.core, prompt))

    async def kv(self) -> KvAnswer:
        return KvAnswer.parse(kv_answer(self.core))


def run(blocks_per_chunk: int) -> str:
    try:
        asyncio.run(run_cpu_tier_sequence(SequenceEngine(blocks_per_chunk)))
    except AssertionError as error:
        return f"failed: {error}"
    return "passed"


def main() -> int:
    json.dump({"per_block": run(1), "per_two_blocks": run(2), "block_size": BLOCK_SIZE}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
