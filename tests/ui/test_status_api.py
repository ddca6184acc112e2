"""GET /admin/ui and /admin/status(/history) over real loopback HTTP (proxy/status_page.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from kvgate.gate.admission import AdmissionController
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.readings import UsageReading
from kvgate.proxy.access_log import session_hash
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import Settings
from kvgate.proxy.status_snapshot import StatusQuery, StatusSources, status_snapshot, usage_summary
from tests.gate.helpers import CLEAN, FakeProbe, settings
from tests.ui.stack import (
    ROOMY,
    TOKEN,
    admin,
    crowd,
    read_replica_metrics,
    replica_metrics_text,
    start_stack,
    turn,
    wait_until,
)


@pytest.fixture
async def stack():
    made = await start_stack()
    yield made
    await made.close()


async def test_the_page_files_are_served_without_the_token_and_the_data_only_with_it(stack):
    async with aiohttp.ClientSession() as http:
        for path, kind in (
            ("/admin/ui", "text/html"),
            ("/admin/ui/app.js", "text/javascript"),
            ("/admin/ui/style.css", "text/css"),
        ):
            async with http.get(stack.url + path) as resp:
                assert resp.status == 200, path
                assert resp.headers["Content-Type"].startswith(kind)
                assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
                assert TOKEN not in await resp.text()
    for path in ("/admin/status", "/admin/status/history", "/admin/state"):
        status, headers, body = await admin(stack.url, "GET", path, token=None)
        assert (status, body["error"]["code"], headers["WWW-Authenticate"]) == (401, "unauthorized", "Bearer"), path
        status, _, _ = await admin(stack.url, "GET", path, token="wrong")
        assert status == 401
        status, headers, _ = await admin(stack.url, "GET", path)
        assert status == 200
        if path.startswith("/admin/status"):  # what the page reads is never cached
            assert headers["Cache-Control"] == "no-store"


async def test_without_an_admin_token_there_is_no_page():
    app = create_app(
        Settings(),
        admission=AdmissionController(settings(), GateMetrics(CollectorRegistry())),
        replicas=[],
        health_checks=False,
    )
    host, port = await app.start("127.0.0.1", 0)
    try:
        status, _, body = await admin(f"http://{host}:{port}", "GET", "/admin/ui", token=None)
        assert (status, body["error"]["code"]) == (404, "admin_api_disabled")
    finally:
        await app.close()


async def test_a_waiting_turn_is_listed_with_its_wait_and_leaves_when_admitted(stack):
    await crowd(stack, True)
    waiting = asyncio.create_task(turn(stack.url, "cold"))
    await wait_until(lambda: stack.controller.counts()["waiters"] == 1, "the turn to wait")
    await asyncio.sleep(0.3)
    _, _, snap = await admin(stack.url, "GET", "/admin/status?view=waiting")
    (waiter,) = snap["waiters"]["items"]
    assert (waiter["session"], waiter["log_id"]) == ("cold", session_hash("cold"))
    assert waiter["waited_sec"] >= 0.3 and waiter["held"]["cause"]
    assert snap["waiters"]["total"] == 1
    assert [s["session"] for s in snap["sessions"]["items"]] == ["cold"]
    replica = next(r for r in snap["replicas"] if r["name"] == waiter["replica"])
    assert replica["gate"]["waiters"] == 1
    assert replica["usage"]["used_blocks"] == 100 and replica["usage"]["num_total_blocks"] == 100
    for script in stack.scripts.values():
        script.kv = dict(ROOMY)
    status, _ = await waiting
    assert status == 200
    _, _, snap = await admin(stack.url, "GET", "/admin/status")
    assert snap["waiters"] == {"total": 0, "items": []}


async def test_sessions_page_and_search_by_id_or_log_hash(stack):
    for i in range(7):
        await turn(stack.url, f"sess-{i}")
    _, _, snap = await admin(stack.url, "GET", "/admin/status?view=all&limit=3&offset=3")
    page = snap["sessions"]
    assert (page["total"], len(page["items"]), page["offset"]) == (7, 3, 3)
    _, _, first = await admin(stack.url, "GET", "/admin/status?view=all&limit=3")
    assert not {s["session"] for s in first["sessions"]["items"]} & {s["session"] for s in page["items"]}
    _, _, found = await admin(stack.url, "GET", "/admin/status?q=sess-4")
    assert [s["session"] for s in found["sessions"]["items"]] == ["sess-4"]
    _, _, by_hash = await admin(stack.url, "GET", f"/admin/status?q={session_hash('sess-5')[:10]}")
    assert [s["session"] for s in by_hash["sessions"]["items"]] == ["sess-5"]
    status, _, body = await admin(stack.url, "GET", "/admin/status?view=everything")
    assert (status, body["error"]["code"]) == (400, "invalid_query")
    status, _, body = await admin(stack.url, "GET", "/admin/status?limit=100000")
    assert status == 400 and "limit" in body["error"]["message"]


async def test_history_gives_the_hit_rate_and_admissions_per_interval(stack):
    stack.scripts["r0"].metrics_text = replica_metrics_text(hits=0, queries=0)
    page = stack.app.status_page
    await read_replica_metrics(stack)
    page.sample()
    stack.scripts["r0"].metrics_text = replica_metrics_text(hits=30, queries=40)
    await read_replica_metrics(stack)
    await turn(stack.url, "h1")
    page.sample()
    _, _, history = await admin(stack.url, "GET", "/admin/status/history")
    assert history["interval_sec"] == 5.0
    assert history["replicas"]["r0"]["hit_rate"][-1] == 0.75
    admitted = sum(v[-1] or 0 for r in history["replicas"].values() for v in r["admissions"].values())
    assert admitted == 1
    _, _, snap = await admin(stack.url, "GET", "/admin/status")
    assert next(r for r in snap["replicas"] if r["name"] == "r0")["hit_rate_1m"] == 0.75


async def test_ten_thousand_sessions_answer_one_page():
    """The snapshot's size follows the page, not the sessions (the gate booked directly:
    10,000 turns over HTTP would take the test's time for nothing)."""
    metrics = GateMetrics(CollectorRegistry())
    controller = AdmissionController(settings(policy="watermark"), metrics, probe_factory=lambda *a: FakeProbe())

    class R:
        name, url = "r0", "http://127.0.0.1:9"

        def describe(self):
            return {"name": self.name}

    for i in range(10_000):
        lease = await controller.acquire(R(), f"s{i:05d}", "chat", {"messages": []})
        lease.release()
    sources = StatusSources(
        "standalone", [R()], controller.gates(), {}, lambda name: {}, lambda name: None, 10_000, 0.0
    )
    snap = status_snapshot(sources, StatusQuery(view="all", limit=50, offset=9_990))
    assert snap["sessions"]["total"] == 10_000
    assert [s["session"] for s in snap["sessions"]["items"]] == [f"s{i:05d}" for i in range(9_990, 10_000)]
    for i in range(10_000):
        controller.finish_session(f"s{i:05d}")
    assert controller.counts() == CLEAN


def test_usage_shows_pinned_and_cpu_tier_blocks_where_the_reading_has_them():
    @dataclasses.dataclass(frozen=True)
    class TieredReading(UsageReading):
        num_pinned_blocks: int | None = None
        num_cpu_blocks: int | None = None
        cpu_load_sec_per_block: float | None = None  # not a count: not shown

    reading = TieredReading(
        0.5,
        num_total_blocks=100,
        num_free_blocks=50,
        num_pinned_blocks=7,
        num_cpu_blocks=400,
        cpu_load_sec_per_block=1e-4,
    )
    summary = usage_summary(reading)
    assert (summary["used_blocks"], summary["num_pinned_blocks"], summary["num_cpu_blocks"]) == (50, 7, 400)
    assert "cpu_load_sec_per_block" not in summary
    assert "num_pinned_blocks" not in usage_summary(UsageReading(0.5, num_total_blocks=100, num_free_blocks=50))
    assert usage_summary(UsageReading(0.3))["used_blocks"] is None  # the /metrics fallback: no block counts
