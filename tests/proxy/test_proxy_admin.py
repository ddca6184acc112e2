"""The admin API: auth, replicas add/remove/drain, state."""

from __future__ import annotations

import pytest
from fake_upstream import FakeUpstream
from proxy_client import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/admin/state"),
        ("POST", "/admin/replicas"),
        ("DELETE", "/admin/replicas/r0"),
        ("POST", "/admin/replicas/r0/drain"),
        ("POST", "/admin/sessions/x/finish"),
    ],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", ADMIN_TOKEN])
async def test_admin_needs_the_bearer_token(proxy, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    resp = await proxy.request(method, path, headers=headers)
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "unauthorized"


async def test_admin_disabled_without_token(make_proxy, upstreams):
    from kvgate.proxy.settings import AdminSettings

    client = await make_proxy(upstreams, admin=AdminSettings(token=None))
    resp = await client.get("/admin/state", headers=ADMIN)
    assert resp.status == 404


async def test_state_lists_replicas(proxy):
    state = await (await proxy.get("/admin/state", headers=ADMIN)).json()
    assert [(r["name"], r["healthy"], r["draining"], r["in_flight"]) for r in state["replicas"]] == [
        ("r0", True, False, 0),
        ("r1", True, False, 0),
    ]
    assert state["gates"] == {}


async def test_add_replica_takes_traffic_and_remove_stops_it(proxy):
    extra = await FakeUpstream("r2").start()
    try:
        resp = await proxy.post("/admin/replicas", json={"name": "r2", "url": extra.url, "weight": 2}, headers=ADMIN)
        assert resp.status == 201
        assert (await resp.json())["weight"] == 2.0
        seen = {
            (await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": f"a{i}"})).headers[
                "x-kvgate-replica"
            ]
            for i in range(30)
        }
        assert "r2" in seen
        assert (await proxy.delete("/admin/replicas/r2", headers=ADMIN)).status == 200
        seen = {
            (await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": f"a{i}"})).headers[
                "x-kvgate-replica"
            ]
            for i in range(30)
        }
        assert seen == {"r0", "r1"}
    finally:
        await extra.stop()


@pytest.mark.parametrize(
    "body, status",
    [
        ({"name": "r0", "url": "http://127.0.0.1:1"}, 409),
        ({"name": "x", "url": "ftp://nope"}, 400),
        ({"name": "x", "url": "http://127.0.0.1:1", "weight": 0}, 400),
        ({"name": "x", "url": "http://127.0.0.1:1", "weight": "heavy"}, 400),
        ({"url": "http://127.0.0.1:1"}, 400),
        ([1], 400),
    ],
)
async def test_add_replica_rejects_bad_input(proxy, body, status):
    resp = await proxy.post("/admin/replicas", json=body, headers=ADMIN)
    assert resp.status == status
    assert (await resp.json())["error"]["message"]


async def test_remove_or_drain_unknown_replica_is_404(proxy):
    assert (await proxy.delete("/admin/replicas/nope", headers=ADMIN)).status == 404
    assert (await proxy.post("/admin/replicas/nope/drain", headers=ADMIN)).status == 404


async def test_drain_stops_new_sessions_but_keeps_existing_ones(proxy):
    placed = {}
    for i in range(20):
        sid = f"d{i}"
        placed[sid] = (await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": sid})).headers[
            "x-kvgate-replica"
        ]
    assert (await proxy.post("/admin/replicas/r0/drain", headers=ADMIN)).status == 200
    for sid, replica in placed.items():  # existing sessions stay where their cache is
        resp = await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": sid})
        assert resp.headers["x-kvgate-replica"] == replica
    for i in range(20):  # new sessions avoid the draining replica
        resp = await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": f"new{i}"})
        assert resp.headers["x-kvgate-replica"] == "r1"
    state = await (await proxy.get("/admin/state", headers=ADMIN)).json()
    assert next(r for r in state["replicas"] if r["name"] == "r0")["draining"] is True


async def test_finished_session_on_a_draining_replica_moves_on_its_next_turn(proxy):
    sid = None
    for i in range(100):
        resp = await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": f"fin{i}"})
        if resp.headers["x-kvgate-replica"] == "r0":
            sid = f"fin{i}"
            break
    await proxy.post("/admin/replicas/r0/drain", headers=ADMIN)
    resp = await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": sid})
    assert resp.headers["x-kvgate-replica"] == "r0"  # still its session
    assert (await proxy.post(f"/admin/sessions/{sid}/finish", headers=ADMIN)).status == 200
    resp = await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": sid})
    assert resp.headers["x-kvgate-replica"] == "r1"  # a new session now: not to the draining replica
