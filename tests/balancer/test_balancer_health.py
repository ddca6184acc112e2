"""Health: the pure state machine, the registry's marking, and the active checker."""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvgate.balancer.health import HealthChecker, HealthState, next_health
from kvgate.balancer.metrics import BalancerMetrics
from kvgate.balancer.registry import ReplicaRegistry
from kvgate.balancer.settings import HealthSettings


def run(results, unhealthy_after=2, healthy_after=2, start=True):
    state = HealthState(healthy=start)
    out = []
    for ok in results:
        state = next_health(state, ok, unhealthy_after, healthy_after)
        out.append(state.healthy)
    return out


def test_unhealthy_only_after_n_consecutive_failures():
    assert run([False, True, False, False]) == [True, True, True, False]


def test_healthy_again_only_after_m_consecutive_successes():
    assert run([True, False, True, True], start=False) == [False, False, False, True]


def test_one_success_is_enough_with_healthy_after_1():
    assert run([True], healthy_after=1, start=False) == [True]


def test_passive_marking_is_immediate_and_checks_bring_it_back():
    metrics = BalancerMetrics(CollectorRegistry())
    registry = ReplicaRegistry(HealthSettings(unhealthy_after=3, healthy_after=2), metrics)
    r0 = registry.add("r0", "http://127.0.0.1:1")
    registry.add("r1", "http://127.0.0.1:2")
    registry.mark_failed(r0)
    assert [r.name for r in registry.routable()] == ["r1"]
    assert metrics.replica_healthy.labels("r0")._value.get() == 0
    registry.record_check(r0, True)
    assert not r0.healthy
    registry.record_check(r0, True)
    assert r0.healthy and len(registry.routable()) == 2
    assert metrics.replica_healthy.labels("r0")._value.get() == 1


def test_answered_requests_keep_a_busy_replica_in_rotation():
    registry = ReplicaRegistry(HealthSettings(unhealthy_after=2))
    r0 = registry.add("r0", "http://127.0.0.1:1")
    registry.record_check(r0, False)  # a check timed out while the replica was busy...
    registry.record_answer(r0)  # ...but it answered a forwarded request
    registry.record_check(r0, False)
    assert r0.healthy
    registry.record_check(r0, False)
    assert not r0.healthy
    registry.record_answer(r0)  # an answer does not revive an unhealthy replica: checks do
    assert not r0.healthy


async def test_checker_polls_health_and_follows_the_answers():
    state = {"ok": True}

    async def health(request):
        return web.Response(status=200 if state["ok"] else 503)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    registry = ReplicaRegistry(HealthSettings(interval_sec=0.05, timeout_sec=1, unhealthy_after=2, healthy_after=1))
    up = registry.add("up", f"http://127.0.0.1:{port}")
    down = registry.add("down", "http://127.0.0.1:9")  # discard port: nothing listens
    checker = HealthChecker(registry, registry._health)
    await checker.start()
    try:

        async def until(predicate):
            for _ in range(200):
                if predicate():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("health state never changed")

        await until(lambda: not down.healthy)
        assert up.healthy
        state["ok"] = False
        await until(lambda: not up.healthy)
        assert not registry.any_healthy()
        state["ok"] = True
        await until(lambda: up.healthy)
    finally:
        await checker.close()
        await runner.cleanup()
