"""`kvgate bench probe-latency` against the real vLLM server: every probe answers 200, idle
and while completions run, and the load really ran while the loaded probes were timed.

Its numbers are the benchmark's to print (docs/bench.md, Probe latency); this test runs
it small and asserts no timing.
"""

from __future__ import annotations

import asyncio

import pytest

from kvgate.bench.probe_latency import PROBES, Options, measure

pytestmark = pytest.mark.vllm


def test_probe_latency_benchmark_on_vllm(vllm_server):
    result = asyncio.run(measure(Options(url=vllm_server.url, samples=3, load_clients=4)))
    for phase in ("idle", "load"):
        for probe in PROBES:
            assert result[phase][probe]["samples"] == 3, (phase, probe)
    assert result["prefix_probe_tokens"] > 900  # the chat body, rendered by vLLM's chat template
    assert result["load_max_running"] > 0 and result["load_requests"] > 0
    assert result["load_failed_requests"] == 0, result["load_errors"]
