"""Windows in the asyncio gate: quiet expiry, the window-end metric by cause,
no window for a request without a prompt or for a turn that served none, and the
work-conserving admission of a held turn. Fake clock; every test ends clean."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.gate.gate import Gate
from kvgate.gate.readings import UsageReading
from tests.gate.helpers import FakeProbe, assert_clean, body, sample, settings, settle, until

# Logic tests: the gate's timers run on the fake clock (see conftest.loop_on_clock).
pytestmark = pytest.mark.usefixtures("loop_on_clock")


def ends(metrics, cause: str) -> float:
    return sample(metrics, "kvgate_window_ends_total", replica="r0", cause=cause) or 0.0


async def test_a_silent_session_loses_its_window_once_quiet_and_the_metric_says_so(metrics, clock):
    probe = FakeProbe(usage=0.9)
    probe.set_prefix("s", total=20, hit=18)
    gate = Gate("r0", probe, settings(quiet_floor_sec=0.5, quiet_factor=4.0), metrics, clock)
    (await gate.acquire("s", "chat", body("s"))).release()  # no gap yet: window lives the floor (0.5 s)
    clock.advance(0.3)
    lease = await gate.acquire("s", "chat", body("s"))  # back after 0.3 s: window kept
    assert lease.reason == "holds_window"
    lease.release()
    state = gate.state()
    assert state["sessions"]["s"]["gap_sec"] == 0.3 and state["sessions"]["s"]["quiet_in_sec"] == 1.2
    clock.advance(1.2)  # 4 x 0.3 s idle: quiet
    state = gate.state()
    assert state["windows"] == {"in_flight": [], "idle": []}
    assert state["sessions"]["s"]["last_window_end"] == "quiet" and state["window_ends"]["quiet"] == 1
    assert ends(metrics, "quiet") == 1 and ends(metrics, "grace") == 0
    assert_clean(gate, clock)


async def test_window_ends_by_finish_lost_and_grace(metrics, clock):
    probe = FakeProbe(usage=0.9)
    probe.set_prefix("a", total=20, hit=18)
    probe.set_prefix("b", total=20, hit=18)
    gate = Gate("r0", probe, settings(idle_grace_sec=10), metrics, clock)  # quiet floor = grace: grace rules
    (await gate.acquire("a", "chat", body("a"))).release()
    (await gate.acquire("b", "chat", body("b"))).release()
    gate.finish_session("a")
    clock.advance(10)
    assert gate.counts()["windows"] == 0
    assert (ends(metrics, "finish"), ends(metrics, "grace"), ends(metrics, "quiet")) == (1, 1, 0)
    assert_clean(gate, clock)


async def test_a_request_without_a_prompt_neither_opens_nor_renews_a_window(metrics, clock):
    probe = FakeProbe(usage=0.9)
    probe.set_prefix("s", total=20, hit=18)
    gate = Gate("r0", probe, settings(), metrics, clock)
    models = await gate.acquire("s", "models", {})
    assert models.reason == "open" and gate.counts()["sessions"] == 0 and probe.usage_calls == 0
    models.release()
    (await gate.acquire("s", "chat", body("s"))).release()
    idle_since = gate.state()["sessions"]["s"]["idle_sec"]
    clock.advance(5)
    (await gate.acquire("s", "models", {})).release()  # does not renew the window
    assert gate.state()["sessions"]["s"]["idle_sec"] == idle_since + 5
    assert_clean(gate, clock)


async def test_a_turn_that_served_no_prompt_leaves_no_new_window(metrics, clock):
    probe = FakeProbe(usage=0.9)
    probe.set_prefix("s", total=20, hit=18)
    gate = Gate("r0", probe, settings(), metrics, clock)
    lease = await gate.acquire("s", "chat", body("s"))
    assert lease.reason == "resident_prefix" and gate.counts()["windows"] == 1
    lease.release(served=False)  # e.g. the upstream answered 404
    assert gate.counts()["windows"] == 0 and ends(metrics, "revoked") == 1
    # a served turn confirms its window; a later failed turn does not take it back
    (await gate.acquire("s", "chat", body("s"))).release()
    failed = await gate.acquire("s", "chat", body("s"))
    assert failed.reason == "holds_window"
    failed.release(served=False)
    assert gate.counts()["windows"] == 1 and ends(metrics, "revoked") == 1
    assert_clean(gate, clock)


class _MeasuredProbe(FakeProbe):
    """100 blocks of 16, measured 16,000 prefill tokens/s and 1 ms decode steps; its engine
    runs `running` requests and has stepped `busy_share` of the time (None: not reported);
    a prefix probe takes `probe_sec` of the clock."""

    def __init__(self, clock, busy_share: float | None = None, running: int = 0, probe_sec: float = 0.0) -> None:
        super().__init__(usage=0.1, total=100, free=100, block_size=16)
        self.clock, self.busy_share, self.running, self.probe_sec = clock, busy_share, running, probe_sec

    async def usage(self, newer_than=None):
        reading = await super().usage(newer_than)
        return UsageReading(
            reading.kv_cache_usage,
            100,
            self.free,
            16,
            prefill_tokens_per_sec=16000.0,
            decode_step_sec=0.001,
            num_running=self.running,
            num_waiting=0,
            busy_share=self.busy_share,
        )

    async def prefix(self, route_kind, body):
        self.clock.advance(self.probe_sec)
        return await super().prefix(route_kind, body)


async def test_a_held_turn_goes_in_work_conserving_once_the_idle_replica_waited_out_the_reprefill(metrics, clock):
    """100 blocks of 16, measured 16,000 prefill tokens/s: `a` owns an idle window of 80
    blocks; `b` (50 new blocks) does not fit. The replica is idle, so b's holding cost is
    the idle time it waited (no gap measured yet); its admission evicts 30 of a's blocks
    and leaves its own 50 unprotected (80 ms of re-prefill): it waits until that much
    idle time passed, then goes in `work_conserving` without a window."""

    probe = _MeasuredProbe(clock)
    probe.set_prefix("a", total=80, hit=0, tokens=80 * 16)
    gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60), metrics, clock)
    (
        await gate.acquire(
            "a", "chat", {"id": "a", "max_tokens": 0, "messages": [{"role": "user", "content": "x" * 2000}]}
        )
    ).release()
    probe.free = 100  # a's 80 blocks are cached and evictable
    probe.set_prefix("b", total=50, hit=0, tokens=50 * 16)
    task = asyncio.create_task(
        gate.acquire("b", "chat", {"id": "b", "max_tokens": 0, "messages": [{"role": "user", "content": "y" * 2000}]})
    )
    await until(lambda: gate.counts()["waiters"] == 1, "b to be held")
    await settle()
    assert not task.done()
    clock.advance(0.081)  # the replica stayed idle longer than the re-prefill b causes (80 ms)
    await until(task.done, "b's recheck")  # its own timer fires (not the 60 s poll)
    lease = task.result()
    assert lease.reason == "work_conserving" and gate.state()["windows"]["in_flight"] == []
    lease.release()
    assert sample(metrics, "kvgate_admissions_total", replica="r0", reason="work_conserving") == 1
    assert_clean(gate, clock)


async def test_a_newcomer_held_behind_a_silent_sessions_window_gets_in_once_it_goes_quiet(metrics, clock):
    """The lead's hang (bench overhead, 256 clients, no finish header): every held turn waited
    with no lease out and the replica idle, behind windows of sessions that had ended without
    saying so, for idle_grace_sec (60 s). Now the window ends once its session is quiet
    (the floor: no gap measured), and the held turn's own timer (bounded by that deadline)
    lets it re-decide: no release is needed to wake it."""
    probe = FakeProbe(usage=0.1, total=100, free=100, block_size=16)
    probe.set_prefix("gone", total=80, hit=0, tokens=80 * 16)
    gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60, quiet_floor_sec=0.05), metrics, clock)
    big = {"max_tokens": 0, "messages": [{"role": "user", "content": "x" * 2000}]}
    (await gate.acquire("gone", "chat", {"id": "gone", **big})).release()  # its last turn; no finish
    probe.set_prefix("next", total=50, hit=0, tokens=50 * 16)
    task = asyncio.create_task(gate.acquire("next", "chat", {"id": "next", **big}))
    await until(lambda: gate.counts()["waiters"] == 1, "the newcomer to be held")
    assert gate.counts()["leases"] == 0  # nothing in flight: no release will wake it
    await settle()
    assert not task.done()
    clock.advance(0.05)  # the silent session's window is quiet now
    await until(task.done, "the newcomer's timer")  # its own timer, not the 60 s poll
    lease = task.result()
    assert lease.reason == "window_fits"
    lease.release()
    assert ends(metrics, "quiet") == 1
    assert_clean(gate, clock)


def _long(session: str) -> dict:
    return {"id": session, "max_tokens": 0, "messages": [{"role": "user", "content": session * 2000}]}


async def test_a_held_turn_on_a_busy_replica_goes_in_once_its_wait_cost_the_reprefill(metrics, clock):
    """As above, but another turn is in flight and the engine steps half the time: b's
    80 ms of re-prefill are paid for by 160 ms of waiting at the engine's idle share (0.5),
    and its own timer lets it re-decide then. An engine that steps all the time holds it."""
    for busy_share, admitted in ((0.5, True), (1.0, False)):
        probe = _MeasuredProbe(clock, busy_share, running=1)
        probe.set_prefix("a", total=80, hit=0, tokens=80 * 16)
        gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60), metrics, clock)
        (await gate.acquire("a", "chat", _long("a"))).release()
        other = await gate.acquire(None, "chat", _long("z"))  # a turn in flight: the replica is busy
        probe.set_prefix("b", total=50, hit=0, tokens=50 * 16)
        task = asyncio.create_task(gate.acquire("b", "chat", _long("b")))
        await until(lambda gate=gate: gate.counts()["waiters"] == 1, "b to be held")
        await settle()
        clock.advance(0.159)
        await settle()
        assert not task.done()
        clock.advance(0.002)
        if admitted:
            await until(task.done, "b's recheck")  # its own timer (not the 60 s poll)
            lease = task.result()
            assert lease.reason == "work_conserving" and gate.state()["windows"]["in_flight"] == []
            lease.release()
        else:
            await settle()
            assert not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        other.release()
        gate.finish_session("a")
        assert_clean(gate, clock)
        gate.close("test over")


async def test_the_gate_learns_how_long_prefix_probes_keep_a_turn_waiting(metrics, clock):
    """Each probe on a turn's path takes 0.4 s of the clock: the gate smooths that latency
    (`prefix_probe_sec`), and once a probe would cost more than the re-prefill it could
    save, a newcomer that would have been probed goes in unprobed."""
    probe = _MeasuredProbe(clock, busy_share=0.5, running=1, probe_sec=0.4)
    probe.set_prefix("a", total=80, hit=0, tokens=80 * 16)
    gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60), metrics, clock)
    (await gate.acquire("a", "chat", _long("a"))).release()
    assert probe.prefix_calls == ["a"]
    assert gate._book.prefix_probe_ewma == pytest.approx(0.4)
    other = await gate.acquire(None, "chat", _long("z"))
    probe.set_prefix("b", total=50, hit=0, tokens=50 * 16)
    lease = await gate.acquire("b", "chat", _long("b"))
    assert lease.reason == "work_conserving" and probe.prefix_calls == ["a"]  # b was not probed
    for held in (lease, other):
        held.release()
    gate.finish_session("a")
    gate.finish_session("b")
    assert_clean(gate, clock)


async def test_a_final_reply_ends_the_window_until_the_session_goes_on_after_one(metrics, clock):
    """`Lease.end_run` (a reply that ended the agent's run) ends the window at once (cause
    `final_reply`) and keeps the record. A session back after its window would have gone
    quiet was right to lose it: its next final reply ends the window again, and the gap
    (a person's) is not taken for its rhythm. One back sooner goes on after such replies:
    from then on they end its windows no more."""
    probe = FakeProbe(usage=0.9)
    for session in ("human", "loop"):
        probe.set_prefix(session, total=20, hit=18)
    gate = Gate("r0", probe, settings(quiet_floor_sec=0.5, quiet_factor=4.0), metrics, clock)
    for session in ("human", "loop"):
        lease = await gate.acquire(session, "chat", body(session))
        lease.end_run()
        lease.release()
        lease.end_run()  # after the release: nothing
    state = gate.state()
    assert state["windows"] == {"in_flight": [], "idle": []} and ends(metrics, "final_reply") == 2
    assert state["sessions"]["loop"]["last_window_end"] == "final_reply"
    clock.advance(0.4)  # within the floor's quiet lifetime (0.5 s): the loop went on
    lease = await gate.acquire("loop", "chat", body("loop"))
    assert lease.reason != "holds_window"  # its window had ended: admitted as a newcomer
    lease.end_run()
    lease.release()
    loop = gate.state()["sessions"]["loop"]
    assert loop["has_window"] and loop["goes_on_after_reply"] and ends(metrics, "final_reply") == 2
    # a person's next message, after the window would have gone quiet (4 x the replica's
    # usual gap of 0.4 s: "human" has no gap of its own yet)
    clock.advance(1.7)
    lease = await gate.acquire("human", "chat", body("human"))
    lease.end_run()
    lease.release()
    state = gate.state()
    assert not state["sessions"]["human"]["has_window"] and not state["sessions"]["human"]["goes_on_after_reply"]
    assert ends(metrics, "final_reply") == 3
    # a person's gap is not the session's rhythm: neither its gap nor the replica's took it in
    assert state["sessions"]["human"]["gap_sec"] is None and state["replica_gap_sec"] == 0.4
    assert state["empty_share"] == 1.0  # its turns took no time on this clock: the replica sat empty all along
    assert_clean(gate, clock)
