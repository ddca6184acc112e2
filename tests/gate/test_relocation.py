"""A held turn moves to a replica with nothing to do (`gate/relocation.py`): through the
controller on fake probes, and through the proxy on fake replicas over HTTP."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import pytest

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.admission import AdmissionController
from kvgate.gate.errors import SessionRelocated
from kvgate.gate.relocation import CLAIM_SEC, relocation_due_sec
from kvgate.gate.settings import ProbeSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.settings import Settings
from tests.gate.fake_replica import ReplicaScript, fake_replica_app
from tests.gate.helpers import CLEAN, FakeClock, FakeProbe, body, sample, settings, settle, until


@dataclass(frozen=True)
class Replica:
    name: str
    url: str


R0, R1 = Replica("r0", "http://r0"), Replica("r1", "http://r1")
PREFILL = 1600.0  # tokens/s both engines measured: a 320-token prompt re-prefills in 0.2 s


def test_a_held_turn_is_due_to_move_once_it_waited_its_re_prefill():
    assert relocation_due_sec(320, PREFILL, 0.05) == pytest.approx(0.15)
    assert relocation_due_sec(320, PREFILL, 0.3) == pytest.approx(-0.1)
    assert relocation_due_sec(None, PREFILL, 1.0) is None  # its prompt unknown: it stays
    assert relocation_due_sec(320, None, 1.0) is None  # no prefill measured: it stays


def two_replicas(metrics, clock, **overrides) -> tuple[AdmissionController, dict[str, FakeProbe]]:
    """A working_set controller over r0 and r1 of 100 blocks each (the books alone decide:
    no block size, so the work-conserving rule cannot price a hold)."""
    probes = {name: FakeProbe(usage=0.1, total=100, free=100, prefill_tokens_per_sec=PREFILL) for name in ("r0", "r1")}
    gate_settings = settings(policy="working_set", wait_poll_sec=60, **overrides)
    controller = AdmissionController(gate_settings, metrics, clock=clock, probe_factory=lambda n, u: probes[n])
    return controller, probes


async def held_on_r0(controller: AdmissionController, probes: dict[str, FakeProbe], *sessions: str, elsewhere=(R1,)):
    """r0's 100 blocks in idle windows of three 30-block sessions, then a cold 30-block,
    320-token turn of each of `sessions` held on r0, offered `elsewhere` to move to."""
    for done in ("a", "b", "c"):
        probes["r0"].set_prefix(done, total=30, hit=0, tokens=480)
        (await controller.acquire(R0, done, "chat", body(done))).release()
    tasks = []
    for session in sessions:
        probes["r0"].set_prefix(session, total=30, hit=0, tokens=320)
        tasks.append(asyncio.create_task(controller.acquire(R0, session, "chat", body(session), lambda: elsewhere)))
    await until(lambda: controller.counts()["waiters"] == len(sessions), "the turns to wait on r0")
    return tasks


async def after(clock: FakeClock, seconds: float) -> None:
    """Move the clock on, and let every woken waiter decide again."""
    clock.advance(seconds)
    await settle()


logic = pytest.mark.usefixtures("loop_on_clock")  # the gates' timers run on the fake clock


@logic
async def test_a_held_turn_moves_to_an_idle_replica_once_it_waited_its_re_prefill(metrics, clock):
    controller, probes = two_replicas(metrics, clock)
    (task,) = await held_on_r0(controller, probes, "d")
    await after(clock, 0.1)
    assert not task.done()  # half its re-prefill: it waits on
    clock.advance(0.1)
    await until(task.done, "d to move")
    with pytest.raises(SessionRelocated) as moved:
        task.result()
    assert moved.value.replica == "r1" and moved.value.code == "session_relocated"
    assert sample(metrics, "kvgate_relocated_turns_total", replica="r0") == 1
    assert controller.gates()["r0"].counts()["waiters"] == 0
    probes["r1"].set_prefix("d", total=30, hit=0, tokens=320)
    (await controller.acquire(R1, "d", "chat", body("d"))).release()  # served where it moved
    clock.advance(61)
    assert controller.counts() == CLEAN


@logic
async def test_it_waits_while_the_other_replica_works_and_moves_when_that_one_goes_idle(metrics, clock):
    controller, probes = two_replicas(metrics, clock)
    probes["r1"].set_prefix("busy", total=10, hit=0, tokens=160)
    busy = await controller.acquire(R1, "busy", "chat", body("busy"))  # r1 has a turn in flight
    (task,) = await held_on_r0(controller, probes, "d")
    await after(clock, 5)
    assert not task.done()  # past its re-prefill, but no replica is idle
    busy.release()  # r1 goes idle: r0's waiters decide again, and d moves
    await until(task.done, "d to move when r1 went idle")
    assert task.exception().replica == "r1"
    clock.advance(61)
    assert controller.counts() == CLEAN


@logic
async def test_two_held_turns_do_not_pile_onto_one_idle_replica(metrics, clock):
    controller, probes = two_replicas(metrics, clock)
    first, second = await held_on_r0(controller, probes, "d", "e")
    clock.advance(0.2)
    await until(lambda: first.done() or second.done(), "one to move")
    await settle()
    assert [first.done(), second.done()] == [True, False]  # r1 is claimed for the one on its way
    controller.gates()["r0"].finish_session("a")  # a window ends: e gets its place on r0
    (await second).release()
    assert first.exception().replica == "r1"
    clock.advance(max(CLAIM_SEC, 61))
    assert controller.counts() == CLEAN


@logic
@pytest.mark.parametrize("why", ["setting off", "nothing offered", "shadow there"])
async def test_a_held_turn_stays_without_the_setting_an_offer_or_an_enforcing_gate_there(metrics, clock, why):
    controller, probes = two_replicas(metrics, clock, relocate_held=why != "setting off")
    if why == "shadow there":
        controller.set_replica_mode("r1", "shadow")
    (task,) = await held_on_r0(controller, probes, "d", elsewhere=() if why == "nothing offered" else (R1,))
    await after(clock, 5)
    assert not task.done()
    controller.gates()["r0"].finish_session("a")
    (await task).release()
    assert sample(metrics, "kvgate_relocated_turns_total", replica="r0") == 0
    clock.advance(61)
    assert controller.counts() == CLEAN


# ------------------------------------------------------------- through the proxy


@pytest.fixture
async def two_replica_proxy(aiohttp_server):
    """Two fake replicas, the proxy app in front with a working_set gate on a fake clock."""
    scripts = [ReplicaScript(), ReplicaScript()]
    servers = [await aiohttp_server(fake_replica_app(s), host="127.0.0.1") for s in scripts]
    clock = FakeClock()
    # whole sessions held (no work-conserving rule): a turn no window fits waits for one
    gate = settings(
        policy="working_set", work_conserving=False, probe=ProbeSettings(timeout_sec=0.5, usage_max_age_ms=0)
    )
    metrics = KvgateMetrics()
    controller = AdmissionController(gate, metrics.gate, clock=clock)
    replicas = tuple(ReplicaSettings(f"r{i}", str(s.make_url("")).rstrip("/")) for i, s in enumerate(servers))
    app = create_app(Settings(gate=gate, replicas=replicas), metrics=metrics, admission=controller, health_checks=False)
    host, port = await app.start("127.0.0.1", 0)
    http = aiohttp.ClientSession(f"http://{host}:{port}")
    yield dict(zip(("r0", "r1"), scripts)), clock, controller, http
    await http.close()
    await app.close()


async def chat(http: aiohttp.ClientSession, session: str) -> tuple[int, str]:
    # a body whose byte bound on its prompt exceeds the 100-block replicas: the gate probes to price it
    body = {"model": "m", "messages": [{"role": "user", "content": f"a turn of {session} " + "x" * 2000}]}
    async with http.post("/v1/chat/completions", json=body, headers={"x-session-id": session}) as resp:
        await resp.read()
        return resp.status, resp.headers["x-kvgate-replica"]


async def test_through_the_proxy_a_held_session_moves_to_the_idle_replica_and_stays_there(two_replica_proxy):
    scripts, clock, controller, http = two_replica_proxy
    for script in scripts.values():  # 100 blocks, all free; a re-prefill costs nothing: a held turn is due at once
        script.kv = {**script.kv, "num_free_blocks": 100, "prefill_tokens_per_sec": 1e9}
        script.prefix("s", total=30, hit=0)
    status, first = await chat(http, "s")
    assert status == 200
    probe = controller.gates()[first].probe  # the reading its release refreshes, before the clock jumps
    await until(lambda: not probe._usage.refreshing, "the usage refresh to end")
    clock.advance(61)  # its window and its record at the gate end; the proxy still pins it to `first`
    scripts[first].kv = {**scripts[first].kv, "num_free_blocks": 0}  # no free block there: a cold turn waits
    other = "r1" if first == "r0" else "r0"
    status, served = await chat(http, "s")  # held on `first`, it moves to the idle `other`
    assert (status, served) == (200, other)
    status, again = await chat(http, "s")
    assert (status, again) == (200, other)  # the session stays where it moved
    relocated = controller.gates()[first]._relocated._value.get()
    assert relocated == 1
    clock.advance(61)
    await until(lambda: controller.counts() == CLEAN, "the gates to be clean")
