"""Prometheus text for the simulated replica's GET /metrics.

vLLM's names and shapes (as its prometheus-client exposition writes them: a counter
family `vllm:x` with a sample `vllm:x_total`, labels `engine` and `model_name`), plus
the simulator's own counters under `kvgate_sim:` for what vLLM does not expose.
Rendered from an engine snapshot; a pure function of its inputs.
"""

from __future__ import annotations

from kvgate.simulator.kv_cache_manager import PrefixCacheStats
from kvgate.simulator.scheduler import SchedulerCounters

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(pairs: dict[str, str]) -> str:
    inner = ",".join(f'{key}="{value}"' for key, value in pairs.items())
    return "{" + inner + "}"


def render_metrics(
    model_name: str,
    block_size: int,
    num_blocks: int,
    kv: dict,  # the engine's kv answer (`KvAnswer.to_json()`)
    counters: SchedulerCounters,
    prefix_stats: PrefixCacheStats,
    num_evictions: int,
) -> str:
    base = _labels({"engine": "0", "model_name": model_name})
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for sample_name, labels, value in samples:
            lines.append(f"{sample_name}{labels} {float(value)!r}")

    def gauge(name: str, help_text: str, value: float) -> None:
        family(name, "gauge", help_text, [(name, base, value)])

    def counter(name: str, help_text: str, value: float) -> None:
        family(name, "counter", help_text, [(name + "_total", base, value)])

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", kv["num_running"])
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", kv["num_waiting"])
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv["kv_cache_usage"])
    counter(
        "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", prefix_stats.queries
    )
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", prefix_stats.hits)
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", counters.num_preemptions)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", counters.num_prompt_tokens)
    counter("vllm:generation_tokens", "Number of generation tokens processed.", counters.num_generation_tokens)
    family(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        [
            (
                "vllm:request_success_total",
                _labels({"engine": "0", "finished_reason": "length", "model_name": model_name}),
                counters.num_finished,
            )
        ],
    )
    family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        [
            (
                "vllm:cache_config_info",
                _labels(
                    {
                        "block_size": str(block_size),
                        "enable_prefix_caching": "True",
                        "engine": "0",
                        "num_gpu_blocks": str(num_blocks + 1),  # vLLM counts its reserved null block
                    }
                ),
                1.0,
            )
        ],
    )
    counter(
        "kvgate_sim:recomputed_tokens",
        "Tokens computed again after their request was preempted.",
        counters.num_recomputed_tokens,
    )
    counter(
        "kvgate_sim:computed_prefill_tokens",
        "Prompt tokens actually computed (misses and recomputation).",
        counters.num_computed_prefill_tokens,
    )
    counter(
        "kvgate_sim:preemptions", "Running requests preempted (blocks freed, state reset).", counters.num_preemptions
    )
    counter("kvgate_sim:evictions", "Cached blocks evicted to be reused.", num_evictions)
    counter(
        "kvgate_sim:preempted_prefix_cache_queries",
        "Prefix cache queries of requests resuming after preemption, in tokens.",
        prefix_stats.preempted_queries,
    )
    counter(
        "kvgate_sim:preempted_prefix_cache_hits",
        "Prefix cache hits of requests resuming after preemption, in tokens.",
        prefix_stats.preempted_hits,
    )
    counter("kvgate_sim:aborted_requests", "Requests aborted (client disconnected).", counters.num_aborted)
    counter("kvgate_sim:steps", "Engine steps run.", counters.num_steps)
    gauge("kvgate_sim:num_free_blocks", "Free blocks (including evictable cached blocks).", kv["num_free_blocks"])
    gauge(
        "kvgate_sim:num_cached_blocks",
        "Blocks holding prefix-cache content (in use or evictable).",
        kv["num_cached_blocks"],
    )
    return "\n".join(lines) + "\n"
