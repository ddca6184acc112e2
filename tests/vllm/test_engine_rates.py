"""The plugin's rate meter over vLLM's prometheus counters (pure; no vLLM needed)."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvgate_vllm.engine_rates import RateMeter, read_totals


def test_rate_meter_by_hand():
    meter = RateMeter(weight=0.5)
    first = {"prompt_tokens": 1000, "hit_tokens": 200, "prefill_sec": 0.1, "generation_tokens": 100, "decode_sec": 1.0}
    assert meter.update(first) == {"prefill_tokens_per_sec": None, "decode_step_sec": None,
                                   "prefill_share": None}  # no delta yet
    # +4,000 prompt tokens, +1,000 hits, +0.2 s of prefill: 15,000 tokens/s; +50 tokens in +0.5 s: 10 ms
    second = {"prompt_tokens": 5000, "hit_tokens": 1200, "prefill_sec": 0.3, "generation_tokens": 150, "decode_sec": 1.5}
    assert meter.update(second) == {"prefill_tokens_per_sec": pytest.approx(15000.0), "decode_step_sec": pytest.approx(0.01),
                                    "prefill_share": pytest.approx(0.2 / 0.7)}
    assert meter.update(second)["prefill_tokens_per_sec"] == pytest.approx(15000.0)  # idle: unchanged


def test_read_totals_from_a_registry_like_vllms():
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Counter("vllm:prompt_tokens", "", labels, registry=registry).labels("m", "0").inc(300)
    Counter("vllm:prefix_cache_hits", "", labels, registry=registry).labels("m", "0").inc(100)
    Counter("vllm:generation_tokens", "", labels, registry=registry).labels("m", "0").inc(40)
    Histogram("vllm:request_prefill_time_seconds", "", labels, registry=registry).labels("m", "0").observe(0.25)
    Histogram("vllm:request_decode_time_seconds", "", labels, registry=registry).labels("m", "0").observe(0.5)
    assert read_totals(registry) == {"prompt_tokens": 300.0, "hit_tokens": 100.0, "prefill_sec": 0.25,
                                     "generation_tokens": 40.0, "decode_sec": 0.5}
