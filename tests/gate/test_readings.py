"""Parsing probe answers into readings: valid answers, and every way one can be garbage."""

from __future__ import annotations

import pytest

from kvgate.gate.readings import (
    PrefixReading,
    ProbeAnswerError,
    UsageReading,
    parse_kv_answer,
    parse_metrics_usage,
    parse_prefix_answer,
)

KV = {
    "version": 1,
    "kv_cache_usage": 0.91,
    "num_total_blocks": 4096,
    "num_free_blocks": 368,
    "num_cached_blocks": 2900,
    "block_size": 16,
    "num_running": 12,
    "num_waiting": 3,
    "engines": [],
}
PREFIX = {
    "version": 1,
    "total_tokens": 5230,
    "total_blocks": 326,
    "hit_blocks": 301,
    "hit_tokens": 4816,
    "hit_ratio": 0.923,
    "hit_blocks_in_use": 12,
    "hit_blocks_evictable": 289,
}


def test_kv_answer_of_the_spec():
    assert parse_kv_answer(KV) == UsageReading(0.91, 4096, 368, 16, "kv", num_running=12, num_waiting=3)
    measured = parse_kv_answer({**KV, "prefill_tokens_per_sec": 20000, "decode_step_sec": 0.006})
    assert (measured.prefill_tokens_per_sec, measured.decode_step_sec) == (20000.0, 0.006)
    assert parse_kv_answer({**KV, "prefill_tokens_per_sec": None}).prefill_tokens_per_sec is None  # not yet measured
    assert parse_kv_answer({"kv_cache_usage": 0}) == UsageReading(0.0)
    assert parse_kv_answer({"kv_cache_usage": 1}).kv_cache_usage == 1.0


@pytest.mark.parametrize(
    "doc, message",
    [
        ([1, 2], "JSON object"),
        ({}, "'kv_cache_usage' must be a number"),
        ({"kv_cache_usage": "0.5"}, "must be a number"),
        ({"kv_cache_usage": True}, "must be a number"),
        ({"kv_cache_usage": 1.5}, r"must lie in \[0, 1\]"),
        ({"kv_cache_usage": -0.1}, r"must lie in \[0, 1\]"),
        ({"kv_cache_usage": float("nan")}, r"must lie in \[0, 1\]"),
        ({"kv_cache_usage": 0.5, "num_total_blocks": 10}, "must come together"),
        ({"kv_cache_usage": 0.5, "num_total_blocks": 10, "num_free_blocks": 11}, "exceeds"),
        ({"kv_cache_usage": 0.5, "num_total_blocks": -1, "num_free_blocks": 0}, "non-negative integer"),
        ({"kv_cache_usage": 0.5, "num_total_blocks": 1.5, "num_free_blocks": 0}, "non-negative integer"),
        ({"kv_cache_usage": 0.5, "prefill_tokens_per_sec": 0}, "positive number or null"),
        ({"kv_cache_usage": 0.5, "decode_step_sec": "fast"}, "positive number or null"),
        ({"kv_cache_usage": 0.5, "decode_step_sec": float("inf")}, "positive number or null"),
    ],
)
def test_kv_answer_garbage(doc, message):
    with pytest.raises(ProbeAnswerError, match=message):
        parse_kv_answer(doc)


def test_prefix_answer_of_the_spec():
    reading = parse_prefix_answer(PREFIX)
    assert reading == PrefixReading(326, 301, 0.923, 5230)
    assert reading.new_blocks == 25


@pytest.mark.parametrize(
    "doc, message",
    [
        ("x", "JSON object"),
        ({"hit_blocks": 1, "hit_ratio": 0.5}, "'total_blocks' must be a non-negative integer"),
        ({"total_blocks": 2, "hit_blocks": 3, "hit_ratio": 1.0}, "exceeds"),
        ({"total_blocks": 2, "hit_blocks": 1, "hit_ratio": 2}, r"\[0, 1\]"),
        ({"total_blocks": 2, "hit_blocks": 1}, "'hit_ratio' must be a number"),
    ],
)
def test_prefix_answer_garbage(doc, message):
    with pytest.raises(ProbeAnswerError, match=message):
        parse_prefix_answer(doc)


METRICS = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:kv_cache_usage_perc_other 0.99
vllm:num_requests_running{engine="0"} 3.0
"""


def test_metrics_fallback_takes_the_busiest_engine():
    assert parse_metrics_usage(METRICS) == UsageReading(0.75, source="metrics")
    assert parse_metrics_usage("vllm:kv_cache_usage_perc 0.5\n").kv_cache_usage == 0.5


@pytest.mark.parametrize(
    "text, message",
    [
        ("vllm:num_requests_running 1\n", "no vllm:kv_cache_usage_perc sample"),
        ('vllm:kv_cache_usage_perc{engine="0"} abc\n', "not a number"),
        ('vllm:kv_cache_usage_perc{engine="0"} 85\n', r"\[0, 1\]"),
        ('vllm:kv_cache_usage_perc{engine="0"}\n', "no value"),
    ],
)
def test_metrics_fallback_garbage(text, message):
    with pytest.raises(ProbeAnswerError, match=message):
        parse_metrics_usage(text)
