"""AdmissionController (Seam 1) with real probes against fake replicas over HTTP."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client import generate_latest

from kvgate.gate.admission import (
    AdmissionController,
    AdmissionSuperseded,
    ReplicaUnavailable,
    session_key,
)
from kvgate.gate.settings import ProbeSettings
from tests.gate.fake_replica import ReplicaScript, fake_replica_app
from tests.gate.helpers import CLEAN, FakeProbe, body, sample, settings, until


@dataclass(frozen=True)
class Replica:
    name: str
    url: str


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def start_replica(aiohttp_server, script: ReplicaScript, name: str) -> Replica:
    server = await aiohttp_server(fake_replica_app(script), host="127.0.0.1")
    return Replica(name, str(server.make_url("")).rstrip("/"))


def assert_clean(controller: AdmissionController, clock) -> None:
    clock.advance(controller.settings.idle_grace_sec + 1)
    assert controller.counts() == CLEAN


@pytest.fixture
async def make_controller(metrics, clock):
    """Controllers built as the proxy builds them (each opens its own ClientSession for
    its probes), closed after the test."""
    made: list[AdmissionController] = []

    def make(gate_settings) -> AdmissionController:
        made.append(AdmissionController(gate_settings, metrics, clock=clock))
        return made[-1]

    yield make
    for controller in made:
        await controller.aclose()


async def test_whole_decision_tree_through_http(aiohttp_server, make_controller, metrics, clock):
    script = ReplicaScript()
    replica = await start_replica(aiohttp_server, script, "r0")
    # every look reads usage afresh: readings are stale at once and unusable after 0.5 s
    gate_settings = settings(
        policy="watermark",
        wait_poll_sec=60,
        idle_grace_sec=10,
        probe=ProbeSettings(timeout_sec=0.5, usage_max_age_ms=0),
    )
    controller = make_controller(gate_settings)

    # below the watermark: open, no prefix probe
    busy = await controller.acquire(replica, "busy", "chat", body("busy"))
    assert busy.reason == "open" and script.prefix_requests == []

    # above it: a resident session passes and gets a window
    script.usage(0.9)
    clock.advance(1)
    script.prefix("hot", total=20, hit=19)
    hot = await controller.acquire(replica, "hot", "chat", body("hot"))
    assert hot.reason == "resident_prefix"
    hot.release()

    # a cold session waits
    cold = asyncio.create_task(controller.acquire(replica, "cold", "chat", body("cold")))
    await until(lambda: controller.counts()["waiters"] == 1)
    assert controller.state()["r0"]["waiters"] == ["cold"]

    # the window holder passes without a prefix probe
    probed = len(script.prefix_requests)
    again = await controller.acquire(replica, "hot", "chat", body("hot"))
    assert again.reason == "holds_window" and len(script.prefix_requests) == probed
    again.release()

    # a retry of the cold session gets the older attempt a 409
    retry = asyncio.create_task(controller.acquire(replica, "cold", "chat", body("cold")))
    with pytest.raises(AdmissionSuperseded):
        await cold
    await until(lambda: controller.counts()["waiters"] == 1 and controller.counts()["attempts"] == 1)

    # a release lets the waiter in once usage drops
    script.usage(0.5)
    busy.release()  # the woken waiter insists on a reading probed after this release
    lease = await retry
    assert lease.reason == "open" and lease.wait_ms >= 0
    lease.release()

    # the window expires: the next look purges it
    state = controller.state()["r0"]
    assert state["windows"]["idle"] == ["hot"]
    assert state["sessions"]["cold"]["num_superseded"] == 1
    assert state["sessions"]["hot"]["reasons"] == {"resident_prefix": 1, "holds_window": 1}
    clock.advance(11)
    assert controller.state()["r0"]["windows"] == {"in_flight": [], "idle": []}
    assert controller.counts() == CLEAN
    assert sample(metrics, "kvgate_session_supersessions_sum") == 1


async def test_gates_are_per_replica_and_created_lazily(metrics, clock):
    probes: dict[str, FakeProbe] = {}

    def factory(name: str, url: str) -> FakeProbe:
        probes[name] = FakeProbe(usage=0.9 if name == "hot" else 0.1)
        probes[name].unavailable.add("s1")
        return probes[name]

    controller = AdmissionController(settings(), metrics, probe_factory=factory, clock=clock)
    assert controller.state() == {}
    a = await controller.acquire(Replica("calm", "http://calm"), "s1", "chat", body("s1"))
    b = await controller.acquire(Replica("hot", "http://hot"), "s1", "chat", body("s1"))
    assert (a.reason, a.replica, b.reason, b.replica) == ("open", "calm", "prefix_probe_unavailable", "hot")
    assert set(controller.state()) == {"calm", "hot"}
    # a replica re-added under the same name with a new url gets a fresh probe, same gate
    old = probes["calm"]
    c = await controller.acquire(Replica("calm", "http://calm2"), "s2", "chat", body("s2"))
    assert probes["calm"] is not old and c.reason == "open"
    for lease in (a, b, c):
        lease.release()
    controller.finish_session("s1")  # on every replica
    controller.finish_session("s2")
    controller.finish_session("unknown")
    assert controller.counts() == CLEAN


async def test_remove_replica_fails_its_waiters_not_others(metrics, clock):
    probe = FakeProbe(usage=0.9)
    controller = AdmissionController(settings(wait_poll_sec=60), metrics, probe_factory=lambda n, u: probe, clock=clock)
    r0, r1 = Replica("r0", "http://r0"), Replica("r1", "http://r1")
    waiters = [asyncio.create_task(controller.acquire(r0, f"s{i}", "chat", body(f"s{i}"))) for i in range(3)]
    other = asyncio.create_task(controller.acquire(r1, "t", "chat", body("t")))
    await until(lambda: controller.counts()["waiters"] == 4)
    controller.remove_replica("r0")
    controller.remove_replica("never-added")
    for task in waiters:
        with pytest.raises(ReplicaUnavailable) as info:
            await task
        assert (info.value.status, info.value.code, info.value.retry_after) == (503, "replica_unavailable", 1)
    assert set(controller.state()) == {"r1"} and not other.done()
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other
    assert_clean(controller, clock)


async def test_a_10kb_session_id_is_booked_hashed_and_never_in_metrics(metrics, clock):
    probe = FakeProbe(usage=0.9)
    probe.set_prefix("big", total=10, hit=10)
    controller = AdmissionController(settings(), metrics, probe_factory=lambda n, u: probe, clock=clock)
    huge = "x" * 10_240
    lease = await controller.acquire(Replica("r0", "http://r0"), huge, "chat", body("big"))
    assert lease.reason == "resident_prefix"
    [key] = controller.state()["r0"]["sessions"]
    assert key == session_key(huge) == hashlib.sha256(huge.encode()).hexdigest()
    assert b"xxxxxxxx" not in generate_latest(metrics.registry)
    lease.release()
    controller.finish_session(huge)
    assert controller.counts() == CLEAN


async def test_controller_opens_and_closes_its_own_client_session(aiohttp_server, metrics, clock):
    script = ReplicaScript()
    replica = await start_replica(aiohttp_server, script, "r0")
    controller = AdmissionController(settings(), metrics, clock=clock)
    lease = await controller.acquire(replica, None, "chat", body("a"))
    assert lease.reason == "anonymous" and script.kv_hits == 1
    lease.release()
    await controller.aclose()
    assert controller.state() == {}


def test_unknown_policy_fails_at_construction(metrics):
    with pytest.raises(ValueError, match="unknown gate.policy"):
        AdmissionController(settings(policy="fifo"), metrics)


async def test_waiters_on_a_replica_that_dies_are_not_stranded(aiohttp_server, make_controller, metrics, clock):
    script = ReplicaScript()
    script.usage(0.95)
    server = await aiohttp_server(fake_replica_app(script), host="127.0.0.1")
    replica = Replica("r0", str(server.make_url("")).rstrip("/"))
    gate_settings = settings(
        policy="watermark", wait_poll_sec=0.02, probe=ProbeSettings(timeout_sec=0.5, usage_max_age_ms=0)
    )
    controller = make_controller(gate_settings)
    waiters = [asyncio.create_task(controller.acquire(replica, f"s{i}", "chat", body(f"s{i}"))) for i in range(3)]
    await until(lambda: controller.counts()["waiters"] == 3)
    await server.close()  # the replica dies: probes fail, usage is unknown
    clock.advance(1)
    leases = [await task for task in waiters]  # admitted `open`; the proxy's upstream error handling takes over
    assert [lease.reason for lease in leases] == ["open"] * 3
    assert sample(metrics, "kvgate_probe_errors_total", replica="r0", probe="kv") >= 1
    for lease in leases:
        lease.release()
    assert_clean(controller, clock)


async def test_placement_counts_the_sessions_each_gate_books(metrics, clock):
    """`placement()`: with the gate enforcing, each replica's live sessions (acquiring, in
    flight, or idle within the grace, not finished); None in the other modes or when off."""
    controller = AdmissionController(
        settings(idle_grace_sec=30), metrics, probe_factory=lambda n, u: FakeProbe(usage=0.1), clock=clock
    )
    on = controller.placement()
    assert on is not None
    a, b = Replica("a", "http://a"), Replica("b", "http://b")
    assert (on(a), on(b)) == (0, 0)  # no gate yet
    leases = [await controller.acquire(a, s, "chat", body(s)) for s in ("s1", "s2")]
    leases.append(await controller.acquire(b, "s3", "chat", body("s3")))
    assert (on(a), on(b)) == (2, 1)
    for lease in leases:
        lease.release()
    assert (on(a), on(b)) == (2, 1)  # idle sessions still count within the grace
    controller.finish_session("s1")
    assert (on(a), on(b)) == (1, 1)
    clock.advance(31)
    assert (on(a), on(b)) == (0, 0)  # the grace ran out
    assert controller.counts() == CLEAN
    for other in (settings(mode="shadow"), settings(mode="off"), settings(place_sessions=False)):
        assert AdmissionController(other, metrics, probe_factory=lambda n, u: FakeProbe()).placement() is None
