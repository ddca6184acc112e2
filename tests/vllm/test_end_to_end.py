"""kvgate in front of a real vLLM CPU server stops prefix-cache thrashing (issue 4, item 5).

The same multi-turn workload (8 sessions x 8 turns, ~60 new prompt tokens a turn,
sessions that together outgrow the 63-usable-block x 32-token cache) runs twice on
the shared server, with the prefix cache reset before each run: once straight to
vLLM, once through ``kvgate serve`` with the gate enforcing. The prefix-cache hit
rate of each run comes from vLLM's own counters (``vllm:prefix_cache_hits_total``
over ``vllm:prefix_cache_queries_total``, deltas), and kvgate's must be at least
twice the direct one. Direct often thrashes down to 0 here, where "twice" proves
nothing, so kvgate must also reach ``MIN_GATED_HIT_RATE``: half of the ~0.80 that two
sessions alone reach on this cache (measured), i.e. most sessions' prefixes kept
resident. Run with ``-s`` to see the numbers.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import pytest

from multiturn_workload import WorkloadShape, run_workload
from vllm_harness import KvgateProxy, free_port, prefix_counters

pytestmark = pytest.mark.vllm

SHAPE = WorkloadShape()
MIN_GATED_HIT_RATE = 0.40
# The contract policy by default: the seed policy reads only live-request usage, which
# is low exactly while idle sessions' prefixes are being evicted (DESIGN.md section 3).
GATE_POLICY = os.environ.get("KVGATE_E2E_POLICY", "contract")


def measured_run(server, base_url: str, seed: int):
    """(workload result, prefix-cache hit rate of this run) with an empty cache at start."""
    server.reset_prefix_cache()
    queries_before, hits_before = prefix_counters(server.url)
    result = asyncio.run(run_workload(base_url, SHAPE, seed=seed))
    queries_after, hits_after = prefix_counters(server.url)
    queries = queries_after - queries_before
    return result, (hits_after - hits_before) / queries if queries else 0.0


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def test_kvgate_at_least_doubles_the_prefix_cache_hit_rate(vllm_server, tmp_path):
    direct, direct_hit_rate = measured_run(vllm_server, vllm_server.url, seed=1)
    assert not direct.failures, direct.failures[:3]

    config = tmp_path / "kvgate.yaml"
    proxy = KvgateProxy(config_path=config, log_path=tmp_path / "kvgate.log", port=free_port())
    KvgateProxy.write_config(config, proxy.port, vllm_server.url,
                             {"mode": "enforce", "policy": GATE_POLICY, "wait_poll_sec": 0.2})
    proxy.start()
    try:
        gated, gated_hit_rate = measured_run(vllm_server, proxy.url, seed=1)
    finally:
        proxy.stop()
    assert not gated.failures, gated.failures[:3] + [proxy.log_tail()]

    total_turns = SHAPE.sessions * SHAPE.turns
    print(
        f"\n[e2e] {SHAPE.sessions} sessions x {SHAPE.turns} turns on {vllm_server.num_blocks - 1} usable "
        f"x {vllm_server.block_size}-token blocks, gate policy {GATE_POLICY}\n"
        f"[e2e] direct: hit rate {direct_hit_rate:.3f}, wall {direct.wall_sec:.1f}s, "
        f"turn p50 {percentile(direct.turn_sec, 0.5):.2f}s\n"
        f"[e2e] kvgate: hit rate {gated_hit_rate:.3f}, wall {gated.wall_sec:.1f}s, "
        f"turn p50 {percentile(gated.turn_sec, 0.5):.2f}s, admissions {dict(Counter(gated.admissions))}, "
        f"wait p50/p95 {percentile(gated.wait_ms, 0.5):.0f}/{percentile(gated.wait_ms, 0.95):.0f} ms"
    )
    assert direct.turns_ok == gated.turns_ok == total_turns
    assert gated.admissions, "no x-kvgate-admission header: did the requests go through kvgate?"
    assert gated_hit_rate >= max(2 * direct_hit_rate, MIN_GATED_HIT_RATE), (
        f"kvgate hit rate {gated_hit_rate:.3f} is not at least twice the direct {direct_hit_rate:.3f} "
        f"and at least {MIN_GATED_HIT_RATE}; "
        f"admission reasons {dict(gated.admissions)} (all 'open' means no gate held anything back: "
        "is the gate wired into `kvgate serve` and does its policy price reserved sessions' blocks?)"
    )
