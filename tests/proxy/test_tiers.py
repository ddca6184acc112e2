"""Front doors over replica gates, end to end on loopback with simulated replicas.

Every part is real: `kvgate replica`'s app, kvgate apps with role replica_gate and
front_door, the owner record. Each test ends by asserting that no gate keeps a lease,
window, waiter or attempt.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.bench.processes import start_in_process
from kvgate.bench.tiers import start_single, start_tiered
from kvgate.gate.ownership import OWNER, Ownership
from kvgate.simulator.reply_model import ReplyModel
from tests.gate.fake_replica import ReplicaScript, fake_replica_app

CLEAN = {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}


def chat(session: str, text: str = "hello", **extra) -> dict:
    return {
        "model": "kvgate-sim",
        "max_tokens": 4,
        **extra,
        "messages": [{"role": "user", "content": f"{session}: {text}"}],
    }


async def post(http, url, path, body, headers=None):
    async with http.post(url + path, json=body, headers=headers or {}) as resp:
        return resp.status, resp.headers.copy(), await resp.json(content_type=None)


async def until(condition, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.02)


def sample(app, name: str, **labels) -> float:
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def tiers():
    made = []

    async def make(*args, **kwargs):
        topology = await start_tiered(*args, **kwargs)
        made.append(topology)
        return topology

    yield make
    for topology in made:
        await topology.close()


async def test_session_semantics_across_tiers(tiers, http):
    # Windows end only by finish or grace here: with the default quiet floor (0.5 s) a loaded
    # machine's pause between two of a session's turns could end one, and its next turn would
    # open a new one (`window_fits`) where this test expects `holds_window`.
    t = await tiers(2, 2, gate={"idle_grace_sec": 30, "quiet_floor_sec": 30}, time_scale=0.0)
    a, b = (d.url for d in t.front_doors)
    replica_of = {}
    for i in range(12):
        sid = f"s{i}"
        status, headers, _ = await post(http, a, "/v1/chat/completions", chat(sid), {"x-session-id": sid})
        assert status == 200
        # the replica gate's admission, not the front door's "open"
        assert headers["x-kvgate-admission"] in ("window_fits", "holds_window")
        assert headers.getall("x-kvgate-admission") == [headers["x-kvgate-admission"]]
        replica_of[sid] = headers["x-kvgate-replica"]
        # the other front door sends the session to the same replica (rendezvous agrees)
        status, headers, _ = await post(http, b, "/v1/chat/completions", chat(sid, "again"), {"x-session-id": sid})
        assert (status, headers["x-kvgate-replica"], headers["x-kvgate-admission"]) == (
            200,
            replica_of[sid],
            "holds_window",
        )
    assert set(replica_of.values()) == {"sim0", "sim1"}
    gates = {g.name: g.app.admission for g in t.replica_gates}
    # the session id reached the replica gate also from a /sess/ path on a route without a session body field
    status, headers, _ = await post(
        http,
        a,
        "/sess/s0/v1/messages",
        {"model": "kvgate-sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 200 and headers["x-kvgate-replica"] == replica_of["s0"]
    assert gates[replica_of["s0"]].state()[replica_of["s0"]]["sessions"]["s0"]["reasons"]["holds_window"] >= 2
    # the front doors gated nothing
    for door in t.front_doors:
        assert all(g["mode"] == "off" and not g["sessions"] for g in door.app.admission.state().values())
    # x-session-finish reaches the replica gate: the window closes there
    for sid in replica_of:
        status, _, _ = await post(
            http, b, "/v1/chat/completions", chat(sid, "bye"), {"x-session-id": sid, "x-session-finish": "true"}
        )
        assert status == 200
    assert t.gate_counts() == CLEAN


async def test_a_final_reply_through_a_front_door_ends_the_window_at_the_replica_gate(tiers, http):
    """The replica gate reads the reply it relays (the front door, gate off, reads none): a
    reply that calls no tool to a request that lets the model choose ends the session's
    window there (cause `final_reply`); one that calls a tool keeps it."""
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    for rate, ended in ((0.0, True), (1.0, False)):
        replies = ReplyModel(median_tokens=8, sigma=0.0, tool_call_rate=rate)
        t = await tiers(1, 1, gate={"idle_grace_sec": 30, "quiet_floor_sec": 30}, time_scale=0.0, reply_model=replies)
        body = chat("agent", max_tokens=64, tools=tools)
        status, headers, answer = await post(
            http, t.front_doors[0].url, "/v1/chat/completions", body, {"x-session-id": "agent"}
        )
        assert (status, answer["choices"][0]["finish_reason"]) == (200, "stop" if ended else "tool_calls")
        (gate,) = t.replica_gates
        state = gate.app.admission.state()[gate.name]
        assert (state["window_ends"]["final_reply"], state["sessions"]["agent"]["has_window"]) == (
            int(ended),
            not ended,
        )
        gate.app.admission.finish_session("agent")
        assert t.gate_counts() == CLEAN


async def test_refusals_pass_through_a_front_door_unchanged(http, aiohttp_server):
    """409 admission_superseded and 503 admission_timeout + Retry-After from the replica gate."""
    script = ReplicaScript()
    script.usage(0.99)  # under pressure; every prompt cold: the watermark policy holds every named turn
    fake = await aiohttp_server(fake_replica_app(script), host="127.0.0.1")
    gate = await start_in_process(
        "fake0",
        {
            "role": "replica_gate",
            "replicas": [{"name": "fake0", "url": str(fake.make_url("")).rstrip("/")}],
            "gate": {
                "mode": "enforce",
                "policy": "watermark",
                # long enough that a loaded machine still sees the waiter before it times out
                "max_wait_sec": 2.0,
                "wait_poll_sec": 0.05,
                "probe": {"usage_max_age_ms": 0},
            },
        },
        health_checks=False,
    )
    door = await start_in_process(
        "door",
        {"role": "front_door", "replicas": [{"name": "fake0", "url": gate.url}], "gate": {"mode": "off"}},
        health_checks=False,
    )
    requests: list[asyncio.Future] = []

    def send(url: str, session: str) -> asyncio.Future:
        requests.append(asyncio.ensure_future(post(http, url, "/v1/chat/completions", body, {"x-session-id": session})))
        return requests[-1]

    body = {"model": "m", "messages": [{"role": "user", "content": "cold"}], "id": "cold"}
    script.prefix("cold", 10, 0)
    try:
        # the timeouts (sessions s, s2) and the superseded turn (session p) wait side by side
        timeouts = send(door.url, "s"), send(gate.url, "s2")
        first = send(door.url, "p")
        await until(lambda: "p" in gate.app.admission.state().get("fake0", {}).get("waiters", []), "a waiter")
        second = send(door.url, "p")
        status, _, err = await first
        assert (status, err["error"]["code"]) == (409, "admission_superseded")
        assert (await second)[0] == 503

        (status, headers, err), direct = await timeouts[0], await timeouts[1]
        assert (status, err["error"]["code"]) == (503, "admission_timeout") == (direct[0], direct[2]["error"]["code"])
        assert headers["Retry-After"] == direct[1]["Retry-After"] and headers["x-kvgate-replica"] == "fake0"
    finally:
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        await door.close()
        await gate.close()
    assert gate.app.admission.counts() == CLEAN


async def test_replica_gate_readiness_follows_its_vllm(tiers, http):
    t = await tiers(2, 1, time_scale=0.0, health_interval_sec=0.05)
    gate0, door = t.replica_gates[0], t.front_doors[0]
    async with http.get(gate0.url + "/ready") as resp:
        assert resp.status == 200
    await t.replicas[0].stop()
    await until(lambda: not gate0.app.registry.any_healthy(), "the replica gate to see its vLLM down")
    async with http.get(gate0.url + "/ready") as resp:
        assert resp.status == 503
    async with http.get(gate0.url + "/health") as resp:
        assert resp.status == 200  # the process is alive: liveness is not readiness
    # the front door checks the replica gate's /ready, so it stops routing there
    await until(lambda: [r.name for r in door.app.registry.all() if r.healthy] == ["sim1"], "the front door")
    for i in range(6):
        status, headers, _ = await post(
            http, door.url, "/v1/chat/completions", chat(f"x{i}"), {"x-session-id": f"x{i}"}
        )
        assert (status, headers["x-kvgate-replica"]) == (200, "sim1")


async def test_conflict_is_detected_and_the_late_gate_shadows(http):
    """Two standalone kvgates enforcing on the same replicas: the naive layout."""
    base = await start_single(
        1, gate={"idle_grace_sec": 30}, extra={"ownership": {"ttl_sec": 3.0, "gate_id": "early"}}, time_scale=0.0
    )
    replica = base.replicas[0]
    early = base.front_doors[0]
    late = await start_in_process(
        "late",
        {"replicas": [{"name": replica.name, "url": replica.url}], "ownership": {"ttl_sec": 3.0, "gate_id": "late"}},
    )
    try:
        # at start: the late gate knows, says so in the metric and /ready, and only shadows
        assert sample(late.app, "kvgate_gate_conflict", replica="sim0") == 1
        async with http.get(late.url + "/ready") as resp:
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "gate_conflict"
        status, headers, _ = await post(http, late.url, "/v1/chat/completions", chat("a"), {"x-session-id": "a"})
        assert status == 200 and headers["x-kvgate-admission"].startswith("shadow_")
        status, headers, _ = await post(http, early.url, "/v1/chat/completions", chat("b"), {"x-session-id": "b"})
        assert not headers["x-kvgate-admission"].startswith("shadow_")
        # the owner learns of the contender at its next renewal
        await until(lambda: sample(early.app, "kvgate_gate_conflict", replica="sim0") == 1, "the owner's gauge")
        async with http.get(early.url + "/ready") as resp:
            assert resp.status == 200
        async with http.get(replica.url + "/v1/kvgate/owner") as resp:
            record = await resp.json()
        assert (record["owned"], record["contenders"]) == (True, 1) and "owner" not in record
        # the owner stops (releasing its record): the late gate takes over and enforces
        for sid in ("a", "b"):
            await post(
                http,
                early.url if sid == "b" else late.url,
                "/v1/chat/completions",
                chat(sid),
                {"x-session-id": sid, "x-session-finish": "true"},
            )
        assert early.app.admission.counts() == CLEAN
        await early.close()
        base.front_doors.clear()
        await until(lambda: sample(late.app, "kvgate_gate_conflict", replica="sim0") == 0, "the take-over")
        status, headers, _ = await post(
            http, late.url, "/v1/chat/completions", chat("c"), {"x-session-id": "c", "x-session-finish": "true"}
        )
        assert status == 200 and not headers["x-kvgate-admission"].startswith("shadow_")
        async with http.get(late.url + "/ready") as resp:
            assert resp.status == 200
    finally:
        await late.close()
        await base.close()
    assert late.app.admission.counts() == CLEAN


async def test_front_door_failover_keeps_sessions_on_their_replicas(tiers):
    """One front door is stopped mid-run: only the turns in flight there fail, and every session
    continues through the other front door on the replica it had."""
    # Every part shares this test's event loop, so on a loaded machine a replica gate's /ready can
    # answer a front door's health check late; at the default 1 s deadline two late answers in a
    # row would mark a healthy replica gate down and move its sessions, which is not the failure
    # played here. 30 s: a replica gate that is really down refuses the connection at once.
    patient_health = {"balancer": {"health": {"timeout_sec": 30.0}}}
    t = await tiers(2, 2, gate={"idle_grace_sec": 30}, front_door=patient_health, time_scale=0.2)
    doors = [d.url for d in t.front_doors]
    sessions = [f"f{i}" for i in range(16)]
    seen: dict[str, set[str]] = {s: set() for s in sessions}
    lost, refused, moved = [], [], set()
    outstanding = [0, 0]  # requests sent to each front door and not answered yet
    killed = asyncio.Event()
    in_flight_at_kill = []

    async def agent(http, index: int, sid: str) -> None:
        door = index % 2
        for turn in range(6):
            headers = {"x-session-id": sid, **({"x-session-finish": "true"} if turn == 5 else {})}
            body = chat(sid, "x" * (40 * turn))
            while True:
                outstanding[door] += 1
                try:
                    status, answer, _ = await post(http, doors[door], "/v1/chat/completions", body, headers)
                    break
                except aiohttp.ClientConnectorError:
                    refused.append(sid)  # never reached the stopped front door: nothing lost
                except (TimeoutError, aiohttp.ClientError):
                    lost.append((sid, turn))  # was in flight there: the client re-sends it
                finally:
                    outstanding[door] -= 1
                assert door == 0
                door = 1
                moved.add(sid)
            assert status == 200
            seen[sid].add(answer["x-kvgate-replica"])
            if turn == 2 and index == 0:
                killed.set()

    async def kill() -> None:
        await killed.wait()
        # In flight there: every request sent to the door and not answered, counted by the clients.
        # The door's own connections would miss those the kernel had accepted for it and the door
        # had not yet taken (reset when it stops listening), more of them the busier the machine.
        in_flight_at_kill.append(outstanding[0])
        await t.front_doors[0].app.close()

    # a connection per request, so a refused connection is told apart from a request in flight
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        await asyncio.gather(kill(), *(agent(http, i, s) for i, s in enumerate(sessions)))
    assert moved, "sessions of the stopped front door moved to the other one"
    assert len(lost) <= in_flight_at_kill[0]
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    # the replica gates release the killed door's turns as they notice its connections closed
    await until(lambda: t.gate_counts() == CLEAN, "every gate clean", timeout=60)


async def check_config(config: dict, tmp_path, capsys) -> tuple[int, str]:
    """`kvgate check-config --contact-replicas` on `config`: (exit code, what it printed)."""
    import argparse

    import yaml

    from kvgate.proxy.commands import check_config_command

    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    code = await asyncio.to_thread(check_config_command, argparse.Namespace(file=str(path), contact_replicas=True))
    out = capsys.readouterr()
    return code, out.out + out.err


async def test_check_config_contact_replicas(tiers, http, tmp_path, capsys):
    """`kvgate check-config --contact-replicas` flags configs that cannot be right on these replicas."""
    t = await tiers(1, 1, time_scale=0.0)
    replica, gate = t.replicas[0], t.replica_gates[0]

    def check(config: dict):
        return check_config(config, tmp_path, capsys)

    # the replica gate holds the simulated replica's record: a second enforcing gate is refused
    code, out = await check({"replicas": [{"name": "sim0", "url": replica.url}]})
    assert code == 2 and "already enforces on it" in out and "replicas[0] (sim0)" in out
    # ... a shadowing one is fine
    code, out = await check({"replicas": [{"name": "sim0", "url": replica.url}], "gate": {"mode": "shadow"}})
    assert code == 0, out
    # a front door must point at replica gates, and a gate must not point at a kvgate
    code, out = await check(
        {"role": "front_door", "gate": {"mode": "off"}, "replicas": [{"name": "sim0", "url": replica.url}]}
    )
    assert code == 2 and "is not a kvgate" in out
    code, out = await check(
        {"role": "front_door", "gate": {"mode": "off"}, "replicas": [{"name": "sim0", "url": gate.url}]}
    )
    assert code == 0, out
    code, out = await check({"replicas": [{"name": "sim0", "url": gate.url}]})
    assert code == 2 and "gate a second time" in out
    code, out = await check({"replicas": [{"name": "gone", "url": "http://127.0.0.1:9"}]})
    assert code == 2 and "unreachable" in out


async def test_check_config_contact_replicas_names_missing_keys(tiers, tmp_path, capsys):
    """With the credentials of docs/security.md wired, a config without them is told which key it lacks."""
    t = await tiers(
        1,
        1,
        replica_gate={"upstream": {"replica_api_key": "rk"}, "auth": {"api_keys": ["door-key"]}},
        front_door={"upstream": {"api_key": "door-key"}},
        replica_api_key="rk",
        time_scale=0.0,
    )
    replica, gate = t.replicas[0], t.replica_gates[0]

    def check(config: dict):
        return check_config(config, tmp_path, capsys)

    shadow = {"gate": {"mode": "shadow"}, "replicas": [{"name": "sim0", "url": replica.url}]}
    code, out = await check(shadow)
    assert code == 2 and "need the replica key" in out and "rk" not in out
    code, out = await check({**shadow, "upstream": {"replica_api_key": "rk"}})
    assert code == 0, out
    door = {"role": "front_door", "gate": {"mode": "off"}, "replicas": [{"name": "sim0", "url": gate.url}]}
    code, out = await check(door)
    assert code == 2 and "asks for a client key" in out
    code, out = await check({**door, "upstream": {"api_key": "door-key"}})
    assert code == 0, out


async def test_removed_replica_record_is_released(http):
    t = await start_single(
        2, extra={"ownership": {"ttl_sec": 0.3, "gate_id": "g"}, "admin": {"token": "t"}}, time_scale=0.0
    )
    try:
        kvgate = t.front_doors[0]

        async def owned(replica) -> bool:
            async with http.get(replica.url + "/v1/kvgate/owner") as resp:
                return (await resp.json())["owned"]

        def held_by_the_gate() -> list[bool]:
            return [kvgate.app.ownership.ownership().get(r.name, Ownership()).status == OWNER for r in t.replicas]

        # The gate claims both replicas once it runs (the first claim races start-up on a loaded machine).
        for _ in range(100):
            if held_by_the_gate() == [True, True]:
                break
            await asyncio.sleep(0.05)
        assert held_by_the_gate() == [True, True] and [await owned(r) for r in t.replicas] == [True, True]
        async with http.delete(kvgate.url + "/admin/replicas/sim1", headers={"Authorization": "Bearer t"}) as resp:
            assert resp.status == 200

        for _ in range(100):
            if not await owned(t.replicas[1]):
                break
            await asyncio.sleep(0.05)
        assert not await owned(t.replicas[1]) and await owned(t.replicas[0])
    finally:
        await t.close()


async def test_front_door_health_timeouts_under_load_are_no_evidence(aiohttp_server):
    """A front door keeps a replica gate that is slow to answer /ready while requests to it are in
    flight (a loaded gate, or this front door's own loop lag); a timeout with nothing in flight, or a
    definitive 503, still counts."""
    from aiohttp import web

    from kvgate.balancer import ReplicaRegistry
    from kvgate.balancer.health import HealthChecker
    from kvgate.balancer.settings import HealthSettings

    answer = {"delay": 0.3, "status": 200}

    async def ready(_request):
        await asyncio.sleep(answer["delay"])
        return web.json_response({}, status=answer["status"])

    app = web.Application()
    app.router.add_get("/ready", ready)
    server = await aiohttp_server(app, host="127.0.0.1")
    health = HealthSettings(interval_sec=60, timeout_sec=0.1, unhealthy_after=1)
    for busy_is_alive, in_flight, delay, status, healthy in [
        (True, 1, 0.3, 200, True),  # timed out, but busy: no evidence
        (True, 0, 0.3, 200, False),  # timed out, idle: a failure
        (True, 1, 0.0, 503, False),  # a definitive answer always counts
        (False, 1, 0.3, 200, False),  # standalone kvgates keep the strict rule
    ]:
        registry = ReplicaRegistry(health)
        replica = registry.add("g0", str(server.make_url("")).rstrip("/"))
        replica.in_flight = in_flight
        answer.update(delay=delay, status=status)
        checker = HealthChecker(registry, health, "/ready", busy_is_alive=busy_is_alive)
        await checker.start()
        try:
            await checker.check_all()
        finally:
            await checker.close()
        assert replica.healthy is healthy, (busy_is_alive, in_flight, delay, status)


async def test_tiers_keep_a_busy_replica_on_a_failed_connect(http):
    """A connect failure to a replica that has requests in flight (a replica gate too loaded to
    accept in time) does not mark it failed or move the session: the turn is tried on it once more."""
    from kvgate.bench.processes import free_port

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens: every connect fails
    for role, in_flight, healthy in [("front_door", 1, True), ("front_door", 0, False), ("standalone", 1, False)]:
        config = {
            "role": role,
            "replicas": [{"name": "g0", "url": urls[0]}, {"name": "g1", "url": urls[1]}],
            "gate": {"mode": "off"},
        }
        kvgate = await start_in_process("door", config, health_checks=False)
        try:
            replica = kvgate.app.balancer.choose("s")
            replica.in_flight = in_flight
            status, _, body = await post(http, kvgate.url, "/v1/chat/completions", chat("s"), {"x-session-id": "s"})
            assert (status, body["error"]["code"]) == (502, "upstream_connect_failed")
            assert replica.healthy is healthy, (role, in_flight)
            replica.in_flight = 0
        finally:
            await kvgate.close()
