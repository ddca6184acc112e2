"""The replicas' counters mirrored into kvgate's /metrics: the pure reader, and the
scraper against real simulated replicas."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import pytest

from kvgate.balancer.health import HealthChecker
from kvgate.balancer.registry import ReplicaRegistry
from kvgate.balancer.replica_metrics import ReplicaMetricsScraper, read_mirrored
from kvgate.balancer.settings import BalancerSettings, HealthSettings, ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.settings import Settings
from kvgate.simulator.replica_server import start_simulated_replicas

VLLM_TEXT = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 800.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""


def test_read_mirrored_sums_engines_and_skips_what_is_absent():
    assert read_mirrored(VLLM_TEXT) == {
        "vllm:prefix_cache_queries_total": 1500.0,
        "vllm:prefix_cache_hits_total": 900.0,
        "vllm:num_requests_running": 3.0,
    }


def test_read_mirrored_ignores_other_series_and_pages_and_rejects_a_broken_sample():
    assert read_mirrored("<html>not metrics</html>\n") == {}
    assert read_mirrored("vllm:num_requests_running_total_x 5\nvllm:num_requests_waiting 2\n") == {
        "vllm:num_requests_waiting": 2.0
    }  # a longer name that merely starts the same is not it
    with pytest.raises(ValueError):
        read_mirrored('vllm:num_requests_running{engine="0" oops\n')


def sample(metrics: KvgateMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def chat(session: aiohttp.ClientSession, url: str, content: str) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def test_scraper_mirrors_each_replicas_own_counters():
    replicas = await start_simulated_replicas(2, host="127.0.0.1", num_blocks=64, time_scale=0.0)
    metrics = KvgateMetrics()
    registry = ReplicaRegistry(HealthSettings(), metrics.balancer)
    for r in replicas:
        registry.add(r.name, r.url)
    scraper = ReplicaMetricsScraper(registry, metrics.gate.probe_seconds, metrics.gate.probe_errors)
    metrics.registry.register(scraper)
    # the health checker runs the mirror's round beside its checks: one round when its loop
    # starts, then the test's own rounds (the next loop round is an hour away)
    checker = HealthChecker(registry, HealthSettings(interval_sec=3600, timeout_sec=2.0))
    checker.add_round(scraper.read_all)
    await checker.start()
    try:
        async with aiohttp.ClientSession() as session:
            prompt = "the same long shared prefix of an agent session " * 8
            for _ in range(3):
                await chat(session, replicas[0].url, prompt)
            await chat(session, replicas[1].url, "something else entirely")
            await scraper.read_all(session)
            for r in replicas:
                async with session.get(r.url + "/metrics") as resp:
                    own = read_mirrored(await resp.text())
                assert (
                    sample(metrics, "kvgate_replica_prefix_cache_queries_total", replica=r.name)
                    == (own["vllm:prefix_cache_queries_total"])
                )
                assert (
                    sample(metrics, "kvgate_replica_prefix_cache_hits_total", replica=r.name)
                    == (own["vllm:prefix_cache_hits_total"])
                )
                assert sample(metrics, "kvgate_replica_num_requests_running", replica=r.name) == 0
                assert sample(metrics, "kvgate_probe_seconds_count", replica=r.name, probe="metrics") == 2
            assert sample(metrics, "kvgate_replica_prefix_cache_hits_total", replica="sim0") > 0  # repeated prompt
            assert sample(metrics, "kvgate_replica_prefix_cache_hits_total", replica="sim1") == 0

            # a replica that stops answering: its counters stay (monotonic), its gauges go
            hits = sample(metrics, "kvgate_replica_prefix_cache_hits_total", replica="sim1")
            await replicas[1].stop()
            await scraper.read_all(session)
            assert sample(metrics, "kvgate_replica_prefix_cache_hits_total", replica="sim1") == hits
            assert sample(metrics, "kvgate_replica_num_requests_running", replica="sim1") is None
            assert sample(metrics, "kvgate_probe_errors_total", replica="sim1", probe="metrics") == 1
            # a removed replica is forgotten
            registry.remove("sim1")
            await scraper.read_all(session)
            assert sample(metrics, "kvgate_replica_prefix_cache_hits_total", replica="sim1") is None
            assert b'kvgate_replica_prefix_cache_queries_total{replica="sim0"}' in metrics.render()
    finally:
        await checker.close()
        for r in replicas:
            await r.stop()


@pytest.mark.parametrize("role, mirrors", [("standalone", True), ("replica_gate", True), ("front_door", False)])
async def test_only_a_process_in_front_of_vllm_mirrors_it(role, mirrors):
    """A front door's replicas are replica gates (kvgates): it reads no /metrics of theirs."""
    replicas = await start_simulated_replicas(1, host="127.0.0.1", num_blocks=64, time_scale=0.0)
    gate = GateSettings(mode="off") if role == "front_door" else GateSettings()
    settings = replace(
        Settings(),
        role=role,
        gate=gate,
        balancer=BalancerSettings(health=HealthSettings(interval_sec=0.05, timeout_sec=2.0)),
    )
    app = create_app(settings, replicas=[ReplicaSettings("r0", replicas[0].url)])
    try:
        await app.start("127.0.0.1", 0)
        for _ in range(100):  # several health rounds
            if app.metrics.registry.get_sample_value(
                "kvgate_probe_seconds_count", {"replica": "r0", "probe": "metrics"}
            ):
                break
            await asyncio.sleep(0.02)
        read = app.metrics.registry.get_sample_value(
            "kvgate_probe_seconds_count", {"replica": "r0", "probe": "metrics"}
        )
        assert bool(read) is mirrors
    finally:
        await app.close()
        await replicas[0].stop()
