"""Pure functions that shape probe answers (docs/reference.md). No vLLM imports.

The engine side measures raw numbers and calls ``kv_usage_result`` /
``prefix_result``; the HTTP side merges one result per engine (data parallelism)
with ``merge_kv_usage`` / ``merge_prefix``. Every result is a dict of plain
msgpack/JSON types, because it crosses vLLM's UTILITY channel and then HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence

PROBE_API_VERSION = 1


def kv_usage_result(
    *,
    num_gpu_blocks: int,
    num_free_blocks: int,
    num_cached_blocks: int,
    block_size: int,
    num_running: int,
    num_waiting: int,
) -> dict:
    """One engine's KV figures.

    ``num_gpu_blocks`` is vLLM's own figure (what ``vllm:cache_config_info`` reports);
    it includes vLLM's reserved null block, so ``num_total_blocks``, the blocks
    requests can use, is one fewer (the simulated replica reports the same).
    ``kv_cache_usage`` equals vLLM's ``BlockPool.get_usage()``: blocks held by live
    requests over usable blocks; cached blocks no live request holds count as free.
    """
    num_total_blocks = max(num_gpu_blocks - 1, 0)
    usage = 1.0 - num_free_blocks / num_total_blocks if num_total_blocks else 0.0
    return {
        "version": PROBE_API_VERSION,
        "kv_cache_usage": usage,
        "num_total_blocks": num_total_blocks,
        "num_gpu_blocks": num_gpu_blocks,
        "num_free_blocks": num_free_blocks,
        "num_cached_blocks": num_cached_blocks,
        "block_size": block_size,
        "num_running": num_running,
        "num_waiting": num_waiting,
    }


def prefix_result(
    *,
    total_tokens: int,
    block_size: int,
    hit_block_ref_counts: Sequence[int],
    hit_tokens: int,
) -> dict:
    """One engine's prefix-residency figures for one prompt.

    ``hit_block_ref_counts`` are the reference counts of the prompt's leading full
    blocks found in the prefix cache (the longest resident run, in order); a block
    with ref count > 0 is held by a live request, the others are evictable.
    ``hit_tokens`` is what the scheduler would reuse if the prompt were admitted
    now (vLLM always recomputes the last prompt token, so it can be one block less
    than ``hit_blocks * block_size``). ``hit_ratio`` is hit full blocks over full
    blocks, 0 when the prompt has no full block.
    """
    total_blocks = total_tokens // block_size if block_size else 0
    hit_blocks = min(len(hit_block_ref_counts), total_blocks)
    in_use = sum(1 for ref_cnt in hit_block_ref_counts[:hit_blocks] if ref_cnt > 0)
    return {
        "version": PROBE_API_VERSION,
        "total_tokens": total_tokens,
        "total_blocks": total_blocks,
        "block_size": block_size,
        "hit_blocks": hit_blocks,
        "hit_tokens": hit_tokens,
        "hit_ratio": hit_blocks / total_blocks if total_blocks else 0.0,
        "hit_blocks_in_use": in_use,
        "hit_blocks_evictable": hit_blocks - in_use,
    }


def merge_kv_usage(per_engine: Sequence[dict]) -> dict:
    """Whole-server KV figures from one result per engine, plus the ``engines`` list.

    Block counts and request counts add up; usage is recomputed over the summed
    usable blocks so it stays "held blocks over usable blocks". The block size is
    the engines' common one (they share one config). ``token_sec``, the marginal
    seconds per scheduled token fitted from an engine's steps (`step_costs`), is the
    largest of the engines that have one.
    """
    if not per_engine:
        raise ValueError("merge_kv_usage needs at least one engine result")
    totals = {
        key: sum(result[key] for result in per_engine)
        for key in (
            "num_total_blocks",
            "num_gpu_blocks",
            "num_free_blocks",
            "num_cached_blocks",
            "num_running",
            "num_waiting",
        )
    }
    usable = totals["num_total_blocks"]
    merged = {
        "version": PROBE_API_VERSION,
        "kv_cache_usage": 1.0 - totals["num_free_blocks"] / usable if usable else 0.0,
        **totals,
        "block_size": per_engine[0]["block_size"],
    }
    fitted = [result["token_sec"] for result in per_engine if result.get("token_sec")]
    if fitted:  # the slowest engine's marginal token cost (a turn may land on any of them)
        merged["token_sec"] = max(fitted)
    merged["engines"] = [{"engine": index, **result} for index, result in enumerate(per_engine)]
    return merged


def merge_prefix(per_engine: Sequence[dict]) -> dict:
    """Whole-server prefix answer: the engine with the fewest hit blocks, plus ``engines``.

    vLLM's data-parallel balancer routes a request by load, not by cache content,
    so the only hit the proxy can count on is the smallest one.
    """
    if not per_engine:
        raise ValueError("merge_prefix needs at least one engine result")
    worst = min(per_engine, key=lambda result: (result["hit_blocks"], result["hit_tokens"]))
    merged = dict(worst)
    merged["engines"] = [{"engine": index, **result} for index, result in enumerate(per_engine)]
    return merged
