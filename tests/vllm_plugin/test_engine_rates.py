"""The plugin's rate meter over vLLM's prometheus counters (pure; no vLLM needed)."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvgate.vllm_plugin.engine_rates import PREFILL_WINDOW_SEC, READ_INTERVAL_SEC, RateMeter, read_totals


def test_rate_meter_by_hand():
    meter = RateMeter(weight=0.5)
    first = {"prompt_tokens": 1000, "hit_tokens": 200, "prefill_sec": 0.1, "generation_tokens": 100, "decode_sec": 1.0}
    assert meter.update(first, now=10.0) == {
        "prefill_tokens_per_sec": None,
        "decode_step_sec": None,
        "prefill_share": None,
    }  # no delta yet
    # +50 tokens in +0.5 s: 10 ms a step; prefill 0.2 of 0.7 busy seconds; the prefill window is still open
    second = {
        "prompt_tokens": 5000,
        "hit_tokens": 1200,
        "prefill_sec": 0.3,
        "generation_tokens": 150,
        "decode_sec": 1.5,
    }
    assert meter.update(second, now=11.0) == {
        "prefill_tokens_per_sec": None,
        "decode_step_sec": pytest.approx(0.01),
        "prefill_share": pytest.approx(0.2 / 0.7),
    }
    # the window closes after PREFILL_WINDOW_SEC: +4,000 prompt tokens, +1,000 hits in +0.2 s of prefill
    # (below the window's 3 s of wall time): 15,000 tokens/s
    assert meter.update(second, now=10.0 + PREFILL_WINDOW_SEC)["prefill_tokens_per_sec"] == pytest.approx(15000.0)
    assert meter.update(second, now=20.0)["prefill_tokens_per_sec"] == pytest.approx(15000.0)  # idle: unchanged


def test_overlapping_prefills_count_the_wall_time_not_their_sum():
    """Eight requests prefilled together over 1 s each report 1 s: 8 s of summed prefill time in a
    3 s window is at most 3 s of the engine's time."""
    meter = RateMeter()
    zero = {"prompt_tokens": 0, "hit_tokens": 0, "prefill_sec": 0.0, "generation_tokens": 0, "decode_sec": 0.0}
    meter.update(zero, now=0.0)
    batch = {**zero, "prompt_tokens": 8 * 600, "prefill_sec": 8 * 1.0}
    assert meter.update(batch, now=PREFILL_WINDOW_SEC)["prefill_tokens_per_sec"] == pytest.approx(
        8 * 600 / PREFILL_WINDOW_SEC
    )


def test_read_totals_from_a_registry_like_vllms():
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Counter("vllm:prompt_tokens", "", labels, registry=registry).labels("m", "0").inc(300)
    Counter("vllm:prefix_cache_hits", "", labels, registry=registry).labels("m", "0").inc(100)
    Counter("vllm:generation_tokens", "", labels, registry=registry).labels("m", "0").inc(40)
    Histogram("vllm:request_prefill_time_seconds", "", labels, registry=registry).labels("m", "0").observe(0.25)
    Histogram("vllm:request_decode_time_seconds", "", labels, registry=registry).labels("m", "0").observe(0.5)
    assert read_totals(registry) == {
        "prompt_tokens": 300.0,
        "hit_tokens": 100.0,
        "prefill_sec": 0.25,
        "generation_tokens": 40.0,
        "decode_sec": 0.5,
    }


def test_the_counters_are_read_at_most_every_read_interval():
    meter = RateMeter()
    assert meter.due(5.0) and meter.figures() == {
        "prefill_tokens_per_sec": None,
        "decode_step_sec": None,
        "prefill_share": None,
    }
    totals = {"prompt_tokens": 0.0, "hit_tokens": 0.0, "prefill_sec": 0.0, "generation_tokens": 0.0, "decode_sec": 0.0}
    meter.update(totals, now=5.0)
    assert not meter.due(5.0 + READ_INTERVAL_SEC / 2)
    assert meter.due(5.0 + READ_INTERVAL_SEC)
    moved = {**totals, "generation_tokens": 10.0, "decode_sec": 0.2}
    figures = meter.update(moved, now=5.0 + READ_INTERVAL_SEC)
    assert figures["decode_step_sec"] == pytest.approx(0.02) and meter.figures() == figures
