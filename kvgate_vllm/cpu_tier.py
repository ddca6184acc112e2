"""The CPU tier: vLLM's native KV offloading (``OffloadingConnector``), as the probes report it.

vLLM offloads KV blocks to CPU memory when started with ``--kv-offloading-size`` (which
makes its ``kv_transfer_config`` an ``OffloadingConnector``) or with an
``OffloadingConnector`` inside a ``MultiConnector`` (beside the retention connector). Its
scheduler side keeps an ``OffloadingManager`` that knows which offloaded blocks ("chunks":
``blocks_per_chunk`` GPU blocks each, keyed by the hash of their last block and the KV
cache group) the CPU holds. This module reads that manager; it imports no vLLM, so tests
drive vLLM's real manager and a stand-in alike.

Invariants:

- read only: the manager is only asked ``lookup`` (vLLM's CPU manager answers it with a
  dict lookup: no recency ``touch``, no ``prepare_load``, no statistic) and its chunk
  counters are read; nothing is stored, loaded, evicted or counted;
- every figure is in blocks of the engine's ``block_size`` tokens: a chunk of
  ``tokens_per_chunk`` tokens is ``tokens_per_chunk // block_size`` blocks;
- only vLLM's CPU manager (``CPUOffloadingManager``, or the primary CPU tier of its
  tiering manager) with one offloaded KV cache group is read: anything else (a hybrid
  model's several groups, another backend) is no CPU tier, and the fields stay null.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BANDWIDTH_ENV = "KVGATE_CPU_LOAD_GBPS"
DEFAULT_LOAD_GBPS = 50.0  # PCIe Gen5 x16, host to device, in practice (64 GB/s raw)
_HIT = ("HIT", "HIT_PENDING")  # vLLM's LookupResult names: the block is (being) stored on the CPU


@dataclass(frozen=True)
class CpuTier:
    """One engine's CPU tier: its manager and how its chunks map to the engine's blocks."""

    manager: Any  # vLLM's CPUOffloadingManager: lookup(key, req_context), _num_chunks, ...
    group_idx: int  # the offloaded KV cache group (its index is part of every key)
    tokens_per_chunk: int  # tokens one offloaded chunk holds
    hashes_per_chunk: int  # request block hashes per chunk (the key is the chunk's last one)
    block_size: int  # the engine's block size, in tokens
    bytes_per_block: int | None  # KV bytes of one engine block on one worker (None: unknown)

    @property
    def blocks_per_chunk(self) -> int:
        return self.tokens_per_chunk // self.block_size


def offloading_scheduler_of(engine_core: Any) -> Any | None:
    """The scheduler side of the engine's offloading connector (the connector itself, or a
    ``MultiConnector``'s child); None when no offloading connector is loaded."""
    connector = getattr(getattr(engine_core, "scheduler", None), "connector", None)
    for candidate in (connector, *getattr(connector, "_connectors", ())):
        side = getattr(candidate, "connector_scheduler", None)
        if hasattr(side, "manager") and hasattr(getattr(side, "config", None), "kv_group_configs"):
            return side
    return None


def _cpu_manager(manager: Any) -> Any | None:
    """vLLM's CPU manager: the manager itself, or a tiering manager's primary (CPU) tier."""
    for candidate in (manager, getattr(manager, "primary_tier", None)):
        if all(hasattr(candidate, name) for name in ("lookup", "_num_chunks", "_num_allocated_chunks", "_free_list")):
            return candidate
    return None


def cpu_tier_of(engine_core: Any) -> CpuTier | None:
    """The engine's CPU tier, or None (no offloading connector, or one this module cannot read)."""
    side = offloading_scheduler_of(engine_core)
    if side is None:
        return None
    manager = _cpu_manager(side.manager)
    groups = side.config.kv_group_configs
    if manager is None or len(groups) != 1:
        return None
    group = groups[0]
    block_size = int(engine_core.scheduler.block_size)
    tokens_per_chunk = int(group.tokens_per_chunk)
    if block_size <= 0 or tokens_per_chunk % block_size:
        return None
    return CpuTier(
        manager=manager,
        group_idx=int(group.group_idx),
        tokens_per_chunk=tokens_per_chunk,
        hashes_per_chunk=int(group.hashes_per_chunk),
        block_size=block_size,
        bytes_per_block=_bytes_per_block(engine_core.scheduler, int(group.group_idx), int(group.tokens_per_block)),
    )


def _bytes_per_block(scheduler: Any, group_idx: int, tokens_per_block: int) -> int | None:
    """KV bytes of one engine block of the offloaded group on one worker (its page times its
    layers, from the scheduler's ``kv_cache_config``); None when the config does not say."""
    try:
        group = scheduler.kv_cache_config.kv_cache_groups[group_idx]
        page = int(group.kv_cache_spec.page_size_bytes)
        layers = len(group.layer_names)
    except (AttributeError, IndexError, TypeError):
        return None
    per_group_block = page if _is_uniform_wrapper(group.kv_cache_spec) else page * layers
    return per_group_block * int(scheduler.block_size) // tokens_per_block if per_group_block > 0 else None


def _is_uniform_wrapper(spec: Any) -> bool:
    # vLLM's UniformTypeKVCacheSpecs already sums its layers' pages (offloading/config.py does the same).
    return type(spec).__name__ == "UniformTypeKVCacheSpecs"


def load_bandwidth(env: Mapping[str, str] | None = None) -> float:
    """Host-to-device bytes per second: ``KVGATE_CPU_LOAD_GBPS`` (GB/s, 1e9 bytes; from `env`,
    default the process environment) or 50 GB/s when unset or not a positive number."""
    raw = (os.environ.get("KVGATE_CPU_LOAD_GBPS", "") if env is None else env.get(BANDWIDTH_ENV, "")).strip()
    try:
        gbps = float(raw) if raw else DEFAULT_LOAD_GBPS
    except ValueError:
        gbps = DEFAULT_LOAD_GBPS
    return (gbps if gbps > 0 else DEFAULT_LOAD_GBPS) * 1e9


def load_sec_per_block(bytes_per_block: int | None, bandwidth: float) -> float | None:
    """Seconds to load one block from the CPU tier: its bytes over the bandwidth."""
    return bytes_per_block / bandwidth if bytes_per_block else None


def capacity_figures(tier: CpuTier, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The kv answer's CPU fields: capacity and held blocks (stored or being stored), in
    engine blocks, and the seconds to load one block."""
    manager = tier.manager
    held_chunks = int(manager._num_allocated_chunks) - len(manager._free_list)
    return {
        "num_cpu_blocks": int(manager._num_chunks) * tier.blocks_per_chunk,
        "num_cpu_cached_blocks": max(held_chunks, 0) * tier.blocks_per_chunk,
        "cpu_load_sec_per_block": load_sec_per_block(tier.bytes_per_block, load_bandwidth(env)),
    }


def cpu_run_blocks(
    tier: CpuTier,
    block_hashes: Sequence[bytes],
    gpu_hit_blocks: int,
    make_key: Callable[[bytes, int], Any],
    req_context: Any,
) -> int:
    """The prompt's blocks right after its first `gpu_hit_blocks` that the CPU tier holds, in
    one run: the chunks from the one holding block `gpu_hit_blocks` on, while ``lookup`` finds
    them (stored or being stored), in engine blocks past the GPU hit.

    `block_hashes` are the prompt's full-block hashes as vLLM's request hasher makes them;
    the key of chunk i is `make_key` (vLLM's ``make_offload_key``) of hash
    ``hashes_per_chunk * (i + 1) - 1`` and the group, as the offloading scheduler makes it."""
    per_chunk = tier.hashes_per_chunk
    num_chunks = len(block_hashes) // per_chunk if per_chunk > 0 else 0
    first = gpu_hit_blocks // tier.blocks_per_chunk
    held = first
    while held < num_chunks:
        key = make_key(block_hashes[per_chunk * (held + 1) - 1], tier.group_idx)
        if getattr(tier.manager.lookup(key, req_context), "name", None) not in _HIT:
            break
        held += 1
    return max(held * tier.blocks_per_chunk - gpu_hit_blocks, 0)
