"""The gate behind the real proxy app (Seam 1): the decision tree end to end over HTTP."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.admission import AdmissionController
from kvgate.gate.settings import ProbeSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.settings import Settings
from tests.gate.fake_replica import ReplicaScript, fake_replica_app
from tests.gate.helpers import CLEAN, FakeClock, settings, until


@pytest.fixture
async def stack(aiohttp_server):
    """A fake replica, a controller on a fake clock, the proxy app in front; all closed after."""
    made = []

    async def make(**overrides):
        script = ReplicaScript()
        server = await aiohttp_server(fake_replica_app(script), host="127.0.0.1")
        clock = FakeClock()
        gate = settings(probe=ProbeSettings(timeout_sec=0.5, usage_max_age_ms=0), **overrides)
        metrics = KvgateMetrics()
        controller = AdmissionController(gate, metrics.gate, clock=clock)
        app = create_app(
            Settings(gate=gate, replicas=(ReplicaSettings("r0", str(server.make_url("")).rstrip("/")),)),
            metrics=metrics,
            admission=controller,
            health_checks=False,
        )
        host, port = await app.start("127.0.0.1", 0)
        http = aiohttp.ClientSession(f"http://{host}:{port}")
        made.append((app, http))
        return script, clock, controller, http

    yield make
    for app, http in made:
        await http.close()
        await app.close()


async def turn(http: aiohttp.ClientSession, session: str, finish: bool = False):
    headers = {"x-session-id": session}
    if finish:
        headers["x-session-finish"] = "true"
    body = {"model": "m", "messages": [{"role": "user", "content": f"next turn of {session}"}]}
    async with http.post("/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, resp.headers.copy(), await resp.json()


async def usage_settled(controller: AdmissionController) -> None:
    """Until no usage refresh runs: a turn's release refreshes the reading in the background
    (`UsageCache.revalidate`), and one still in flight when the fake clock jumps looks like
    a probe that took that long."""
    probe = controller.gates()["r0"].probe
    await until(lambda: not probe._usage.refreshing, "the usage refresh to end")


async def test_decision_tree_end_to_end(stack):
    script, clock, controller, http = await stack(policy="watermark", wait_poll_sec=60, idle_grace_sec=10)

    status, headers, _ = await turn(http, "busy")
    assert (status, headers["x-kvgate-admission"], headers["x-kvgate-replica"]) == (200, "open", "r0")
    assert script.prefix_requests == []
    await usage_settled(controller)  # the reading its release refreshed

    script.usage(0.9)
    clock.advance(1)
    script.prefix("hot", total=20, hit=19)
    status, headers, _ = await turn(http, "hot")
    assert (status, headers["x-kvgate-admission"]) == (200, "resident_prefix")
    assert script.prefix_requests[-1]["chat"]["session_id"] == "hot"  # the body as forwarded, rendered by the replica

    cold = asyncio.create_task(turn(http, "cold"))
    await until(lambda: controller.counts()["waiters"] == 1, "the cold session to wait")
    retry = asyncio.create_task(turn(http, "cold"))
    status, _, body = await cold
    assert (status, body["error"]["code"]) == (409, "admission_superseded")

    status, headers, _ = await turn(http, "hot")  # holds a window: passes the waiter, no probe
    assert headers["x-kvgate-admission"] == "holds_window"
    await until(lambda: controller.counts()["waiters"] == 1)

    script.usage(0.5)
    status, headers, _ = await turn(http, "hot", finish=True)  # its release wakes the waiter
    status, headers, _ = await retry
    assert (status, headers["x-kvgate-admission"]) == (200, "open")
    assert float(headers["x-kvgate-wait-ms"]) >= 0

    state = controller.state()["r0"]
    assert state["sessions"]["cold"]["num_superseded"] == 1
    assert "hot" not in state["sessions"]  # finished by the header
    clock.advance(11)
    assert controller.counts() == CLEAN


async def test_timeout_and_prompt_too_long_over_http(stack):
    script, clock, controller, http = await stack(policy="working_set", max_wait_sec=5, wait_poll_sec=0.01)
    script.kv = {"kv_cache_usage": 0.5, "num_total_blocks": 100, "num_free_blocks": 10}
    script.prefix("huge", total=101, hit=0)
    status, _, body = await turn(http, "huge")
    assert (status, body["error"]["code"]) == (400, "prompt_too_long")

    script.prefix("cold", total=50, hit=0)  # 50 new blocks, 10 free: waits
    waiting = asyncio.create_task(turn(http, "cold"))
    await until(lambda: controller.counts()["waiters"] == 1)
    clock.advance(6)
    status, headers, body = await waiting
    assert (status, body["error"]["code"], headers["Retry-After"]) == (503, "admission_timeout", "1")
    clock.advance(61)
    assert controller.counts() == CLEAN


async def test_a_turn_the_upstream_answers_404_and_a_models_request_leave_no_window(stack):
    """A request without a prompt (GET /v1/models) never touches the gate's
    books; a turn whose upstream answers 404 (the fake replica serves no /v1/completions)
    was admitted into a new window, which ends (`revoked`) when its lease is released."""
    script, clock, controller, http = await stack(policy="watermark", wait_poll_sec=60, idle_grace_sec=10)
    script.usage(0.9)
    script.prefix("lost", total=20, hit=19)
    async with http.get("/v1/models", headers={"x-session-id": "lost"}) as resp:
        assert resp.headers["x-kvgate-admission"] == "open"
    assert controller.counts() == CLEAN  # no session record, no window
    body = {"model": "m", "prompt": "hello"}
    async with http.post("/v1/completions", json=body, headers={"x-session-id": "lost"}) as resp:
        assert (resp.status, resp.headers["x-kvgate-admission"]) == (404, "resident_prefix")
    assert controller.counts()["windows"] == 0
    state = controller.state()["r0"]
    assert state["window_ends"]["revoked"] == 1 and state["sessions"]["lost"]["last_window_end"] == "revoked"
    clock.advance(11)
    assert controller.counts() == CLEAN
