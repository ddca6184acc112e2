"""The two probes, computed inside vLLM's engine core (vLLM 0.32-0.34, V1 engine).

Both functions take an ``EngineCore`` (or anything with the same ``scheduler`` and
``request_block_hasher`` attributes) and only *read* it. Invariants, checked by
tests/vllm against the real ``KVCacheManager``/``BlockPool``:

- no block is allocated, freed or touched: the free queue's LRU order, every ref
  count and the block-hash map are unchanged (one exception: with the retention
  connector loaded, the kv answer first ends KV pins whose ttl has passed, as the next
  scheduler step would, so a ttl ends on an idle engine too);
- no prefix-cache statistic is recorded (``make_stats``/``make_prefix_cache_stats``
  reset counters and are never called) and no KV event is queued;
- the throw-away ``Request`` built to hash the prompt is never registered anywhere.

vLLM internals used (listed in ``vllm_internals``, checked against every supported
release by ``compat_check``; feature-detected: a missing one yields ``{"error": ...}``):
``scheduler.kv_cache_manager.block_pool`` (``num_gpu_blocks``,
``get_num_free_blocks()``, ``cached_block_hash_to_block``),
``scheduler.get_request_counts()``, ``scheduler.block_size``,
``kv_cache_manager.coordinator.find_longest_cache_hit(block_hashes, max_length)``,
``EngineCore.request_block_hasher`` and ``vllm.v1.request.Request``; the kv answer's pin
fields come from the retention connector's ``PinKeeper`` (``scheduler.connector``), when loaded;
the CPU tier's fields (kv answer ``num_cpu_*``, ``cpu_load_sec_per_block``; prefix answer
``hit_blocks_cpu``) from vLLM's offloading manager (`cpu_tier`), when offloading is on: a CPU
tier the plugin cannot read leaves them null and never fails an answer.
"""

from __future__ import annotations

from typing import Any

from kvgate.vllm_plugin.cpu_tier import capacity_figures, cpu_run_blocks, cpu_tier_of
from kvgate.vllm_plugin.pin_keeper import pin_figures
from kvgate.vllm_plugin.support import SUPPORTED_TEXT
from kvgate.wire.probe_api import KvAnswer, PrefixAnswer

SUPPORTED_VLLM = f"vLLM {SUPPORTED_TEXT}"
PROBE_REQUEST_ID = "kvgate-prefix-probe"


def _unsupported(what: str, exc: BaseException) -> dict:
    return {
        "error": (
            f"kvgate_vllm cannot {what} on this vLLM build ({type(exc).__name__}: {exc}); "
            f"the plugin is tested on {SUPPORTED_VLLM}: install a matching kvgate or vLLM version"
        )
    }


def _cached_block_count(block_pool: Any) -> int:
    """Prefix-cache entries (full blocks with a hash, in use or evictable), in O(1).

    ``cached_block_hash_to_block`` has one key per distinct block hash, so identical
    blocks cached twice count once, which is what a prefix lookup can find."""
    return len(block_pool.cached_block_hash_to_block)


def kv_answer(engine_core: Any) -> dict:
    """This engine's ``KvAnswer`` (as JSON: it crosses the UTILITY channel), in constant time."""
    try:
        scheduler = engine_core.scheduler
        block_pool = scheduler.kv_cache_manager.block_pool
        num_running, num_waiting = scheduler.get_request_counts()
        return KvAnswer.of_engine(
            num_gpu_blocks=int(block_pool.num_gpu_blocks),
            num_free_blocks=int(block_pool.get_num_free_blocks()),
            num_cached_blocks=_cached_block_count(block_pool),
            block_size=int(scheduler.block_size),
            num_running=int(num_running),
            num_waiting=int(num_waiting),
            **pin_figures(engine_core),
            **cpu_tier_figures(engine_core),
        ).to_json()
    except (AttributeError, TypeError, ValueError) as exc:
        return _unsupported("read KV usage", exc)


_CPU_TIER_ERRORS = (AttributeError, ImportError, IndexError, TypeError, ValueError)


def cpu_tier_figures(engine_core: Any) -> dict:
    """The kv answer's CPU-tier fields; {} without a CPU tier the plugin can read (they stay null)."""
    try:
        tier = cpu_tier_of(engine_core)
        return capacity_figures(tier) if tier is not None else {}
    except _CPU_TIER_ERRORS:
        return {}


def hit_blocks_cpu(engine_core: Any, block_hashes: Any, gpu_hit_blocks: int) -> int | None:
    """The prompt's run of CPU-tier blocks after its GPU hit (`cpu_tier.cpu_run_blocks`, keyed
    with vLLM's ``make_offload_key``); None without a CPU tier the plugin can read."""
    try:
        tier = cpu_tier_of(engine_core)
        if tier is None:
            return None
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key

        context = ReqContext(req_id=PROBE_REQUEST_ID)
        return cpu_run_blocks(tier, list(block_hashes), gpu_hit_blocks, make_offload_key, context)
    except _CPU_TIER_ERRORS:
        return None


def build_probe_request(
    token_ids: list[int],
    cache_salt: str | None,
    lora: dict | None,
    block_hasher: Any,
) -> Any:
    """A ``vllm.v1.request.Request`` whose constructor computes the prompt's block
    hashes with the engine's own hasher (same hash function, NONE_HASH and extra
    keys: LoRA on every block, ``cache_salt`` on the first). Never scheduled."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    lora_request = LoRARequest(**lora) if lora else None
    return Request(
        request_id=PROBE_REQUEST_ID,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        lora_request=lora_request,
        cache_salt=cache_salt or None,
        block_hasher=block_hasher,
    )


def prefix_answer(
    engine_core: Any,
    token_ids: list[int],
    cache_salt: str | None = None,
    lora: dict | None = None,
) -> dict:
    """This engine's ``PrefixAnswer`` for the prompt (as JSON: it crosses the UTILITY channel).

    ``hit_blocks`` counts resident leading full blocks (lookup up to the whole
    prompt); ``hit_tokens`` repeats the scheduler's own lookup (up to the prompt
    length minus one, because the last token is always recomputed).
    """
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
        return {"error": "token_ids must be a list of integers"}
    try:
        scheduler = engine_core.scheduler
        manager = scheduler.kv_cache_manager
        block_size = int(scheduler.block_size)
        block_hasher = engine_core.request_block_hasher
        caching_enabled = bool(manager.enable_caching)
    except AttributeError as exc:
        return _unsupported("look up prefix-cache residency", exc)
    if block_hasher is None or not caching_enabled:
        return {
            "error": (
                "prefix caching is disabled on this vLLM server; start it without "
                "--no-enable-prefix-caching to use the prefix probe"
            )
        }
    try:
        request = build_probe_request(token_ids, cache_salt, lora, block_hasher)
        coordinator = manager.coordinator
        resident, _, _ = coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens)
        _, reusable_tokens, _ = coordinator.find_longest_cache_hit(request.block_hashes, max(request.num_tokens - 1, 0))
    except (AttributeError, TypeError) as exc:
        return _unsupported("look up prefix-cache residency", exc)
    first_group = resident[0] if resident else []
    return PrefixAnswer.of_engine(
        total_tokens=len(token_ids),
        block_size=block_size,
        hit_block_ref_counts=[block.ref_cnt for block in first_group],
        hit_tokens=int(reusable_tokens),
        hit_blocks_cpu=hit_blocks_cpu(engine_core, request.block_hashes, len(first_group)),
    ).to_json()
