"""kvgate mirrors a real vLLM server's prefix-cache counters into its own /metrics
(docs/observability.md), and marks the replica as answering the probe API."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import aiohttp
import pytest
from vllm_harness import prefix_counters

from kvgate.balancer.settings import BalancerSettings, HealthSettings, ReplicaSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import Settings

pytestmark = pytest.mark.vllm


async def test_kvgate_mirrors_vllms_prefix_cache_counters(vllm_server):
    settings = replace(Settings(), balancer=BalancerSettings(health=HealthSettings(interval_sec=0.2, timeout_sec=5.0)))
    app = create_app(settings, replicas=[ReplicaSettings("v0", vllm_server.url)])
    host, port = await app.start("127.0.0.1", 0)
    kvgate = f"http://{host}:{port}"
    system = f"You are a careful agent {uuid.uuid4().hex}. " * 20  # a prefix no other test sends
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}],
    }
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(2):  # the second turn hits the first one's blocks
                async with http.post(
                    kvgate + "/v1/chat/completions", json=body, headers={"x-session-id": "mirror"}
                ) as resp:
                    assert resp.status == 200, await resp.text()
            own = await asyncio.to_thread(prefix_counters, vllm_server.url)
            mirrored = None
            for _ in range(100):  # the next health round reads it (interval 0.2 s)
                samples = app.metrics.registry
                mirrored = (
                    samples.get_sample_value("kvgate_replica_prefix_cache_queries_total", {"replica": "v0"}),
                    samples.get_sample_value("kvgate_replica_prefix_cache_hits_total", {"replica": "v0"}),
                )
                if mirrored == own:
                    break
                await asyncio.sleep(0.1)
            assert mirrored == own and own[1] > 0, (mirrored, own)
            assert app.metrics.registry.get_sample_value("kvgate_replica_probe_api", {"replica": "v0"}) == 1
            assert (
                app.metrics.registry.get_sample_value("kvgate_replica_num_requests_running", {"replica": "v0"})
                is not None
            )
    finally:
        await app.close()
    assert app.admission.counts() == {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}
