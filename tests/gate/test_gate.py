"""The asyncio gate with a fake clock and a fake probe. Every test ends with nothing left."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.gate.errors import AdmissionSuperseded, AdmissionTimeout, PromptTooLong, ReplicaUnavailable
from kvgate.gate.gate import HELD_READING_MAX_AGE_SEC, Gate
from tests.gate.helpers import CLEAN, FakeProbe, assert_clean, body, sample, settings, until

# Logic tests: the gate's timers run on the fake clock (see conftest.loop_on_clock).
pytestmark = pytest.mark.usefixtures("loop_on_clock")

HIGH = 0.9
LOW = 0.1


def make_gate(probe, metrics, clock, **overrides) -> Gate:
    return Gate("r0", probe, settings(**overrides), metrics, clock)


def waiting(gate: Gate) -> int:
    return gate.counts()["waiters"]


async def test_open_below_watermark_asks_no_prefix_probe(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock)
    lease = await gate.acquire("s1", "chat", body("s1"))
    assert (lease.reason, lease.wait_ms, lease.replica) == ("open", 0.0, "r0")
    assert probe.prefix_calls == []
    assert gate.counts() == {**CLEAN, "leases": 1, "sessions": 1}
    lease.release()
    lease.release()  # idempotent: the lease count does not go negative
    assert gate.counts()["leases"] == 0
    assert sample(metrics, "kvgate_admissions_total", replica="r0", reason="open") == 1
    assert sample(metrics, "kvgate_admission_wait_seconds_count", replica="r0") == 1
    assert_clean(gate, clock)


async def test_resident_prefix_opens_a_window_and_next_turn_holds_it_without_probe(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock)
    probe.usage_value = HIGH
    probe.set_prefix("s1", total=20, hit=18)
    lease = await gate.acquire("s1", "chat", body("s1"))
    assert lease.reason == "resident_prefix"
    assert gate.state()["windows"] == {"in_flight": ["s1"], "idle": []}
    assert sample(metrics, "kvgate_windows", replica="r0", state="in_flight") == 1
    lease.release()
    assert gate.state()["windows"] == {"in_flight": [], "idle": ["s1"]}
    assert sample(metrics, "kvgate_windows", replica="r0", state="idle") == 1
    clock.advance(30)  # a tool call inside the grace window
    probe.prefixes.clear()
    second = await gate.acquire("s1", "chat", body("s1"))
    assert second.reason == "holds_window"
    assert probe.prefix_calls == ["s1"]  # only the first turn was probed
    second.release()
    assert gate.state()["sessions"]["s1"]["reasons"] == {"resident_prefix": 1, "holds_window": 1}
    assert_clean(gate, clock)
    assert sample(metrics, "kvgate_windows", replica="r0", state="idle") == 0


async def test_cold_session_waits_and_a_release_lets_it_in(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, wait_poll_sec=60)  # only the release can wake it
    holder = await gate.acquire("busy", "chat", body("busy"))
    probe.usage_value = HIGH
    task = asyncio.create_task(gate.acquire("cold", "chat", body("cold")))
    await until(lambda: waiting(gate) == 1, "the cold session to wait")
    assert gate.state()["waiters"] == ["cold"]
    assert sample(metrics, "kvgate_waiters", replica="r0") == 1
    clock.advance(2.5)
    probe.usage_value = LOW
    holder.release()
    lease = await task
    assert lease.reason == "open" and lease.wait_ms == pytest.approx(2500)
    # first look: any recent reading; after the wake: one read after the release
    assert probe.newer_than[0] is None and probe.newer_than[-1] == clock()
    assert sample(metrics, "kvgate_waiters", replica="r0") == 0
    lease.release()
    assert_clean(gate, clock)


async def test_prefix_unavailable_admits_without_window(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock)
    probe.usage_value = HIGH
    probe.unavailable.add("s1")
    lease = await gate.acquire("s1", "chat", body("s1"))
    assert lease.reason == "prefix_probe_unavailable"
    assert gate.counts()["windows"] == 0
    lease.release()
    assert_clean(gate, clock)


async def test_usage_unknown_admits_open(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock)
    probe.usage_value = None
    lease = await gate.acquire("s1", "chat", body("s1"))
    assert lease.reason == "open" and probe.prefix_calls == []
    lease.release()
    assert_clean(gate, clock)


async def test_anonymous_checked_against_watermark_only_and_never_booked(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, wait_poll_sec=60)
    first = await gate.acquire(None, "chat", body("a"))
    assert first.reason == "anonymous"
    assert gate.counts() == {**CLEAN, "leases": 1}
    probe.usage_value = HIGH
    probe.set_prefix("a", total=10, hit=10)  # resident, but anonymous requests are not probed
    task = asyncio.create_task(gate.acquire(None, "chat", body("a")))
    await until(lambda: waiting(gate) == 1)
    assert gate.state()["waiters_anonymous"] == 1 and probe.prefix_calls == []
    probe.usage_value = LOW
    first.release()
    second = await task
    assert second.reason == "anonymous"
    second.release()
    assert_clean(gate, clock)


async def test_release_wakes_one_waiter_in_arrival_order_not_a_herd(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, wait_poll_sec=60)
    holder = await gate.acquire("busy", "chat", body("busy"))
    other = await gate.acquire("other", "chat", body("other"))  # in flight throughout: the replica stays busy
    probe.usage_value = HIGH
    tasks = [asyncio.create_task(gate.acquire(s, "chat", body(s))) for s in ("a", "b", "c")]
    await until(lambda: waiting(gate) == 3)
    assert probe.prefix_calls == ["a", "b", "c"]
    usage_calls = probe.usage_calls
    holder.release()  # still under pressure: exactly the head re-evaluates (on its last reading: no probe)
    await until(lambda: probe.usage_calls == usage_calls + 1)
    for _ in range(50):
        await asyncio.sleep(0)
    assert probe.usage_calls == usage_calls + 1 and probe.prefix_calls == ["a", "b", "c"]
    # pressure ends: an `open` admission wakes the head, each admitted waiter the next.
    probe.usage_value = LOW
    extra = await gate.acquire("x", "chat", body("x"))  # an open admission wakes the head ...
    lease_a = await tasks[0]
    lease_b = await tasks[1]  # ... and each admitted waiter wakes the next
    lease_c = await tasks[2]
    assert [lease.reason for lease in (lease_a, lease_b, lease_c)] == ["open"] * 3
    for lease in (extra, lease_a, lease_b, lease_c, other):
        lease.release()
    assert_clean(gate, clock)


async def test_window_expiry_is_purged_lazily_and_wakes_a_waiter(metrics, clock):
    # working_set policy: the idle window's blocks are priced, so its expiry lets the waiter in.
    probe = FakeProbe(usage=0.3, total=100, free=70)
    gate = make_gate(probe, metrics, clock, policy="working_set", wait_poll_sec=60, idle_grace_sec=10)
    probe.set_prefix("owner", total=50, hit=0)
    owner = await gate.acquire("owner", "chat", body("owner"))
    assert owner.reason == "window_fits"
    owner.release()  # idle window of 50 blocks: 70 free - 50 = 20 left for others
    probe.set_prefix("cold", total=30, hit=0)
    task = asyncio.create_task(gate.acquire("cold", "chat", body("cold")))
    await until(lambda: waiting(gate) == 1)
    calls = len(probe.prefix_calls)
    clock.advance(9)
    gate.state()  # a look before the grace is over: nothing expires
    assert gate.state()["windows"]["idle"] == ["owner"] and not task.done()
    clock.advance(2)
    assert gate.state()["windows"]["idle"] == []  # purged by this look, which wakes the waiter
    lease = await task
    assert lease.reason == "window_fits" and len(probe.prefix_calls) == calls + 1
    lease.release()
    assert_clean(gate, clock)


async def test_watermark_window_expiry_ends_window_and_session(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, idle_grace_sec=10)
    probe.usage_value = HIGH
    probe.set_prefix("s1", total=10, hit=9)
    (await gate.acquire("s1", "chat", body("s1"))).release()
    clock.advance(10)
    probe.prefixes.clear()
    task = asyncio.create_task(gate.acquire("s1", "chat", body("s1")))  # window over: probed again, cold
    await until(lambda: waiting(gate) == 1)
    assert probe.prefix_calls == ["s1", "s1"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_clean(gate, clock)


async def test_finish_session_ends_window_and_wakes_waiter(metrics, clock):
    probe = FakeProbe(usage=0.3, total=100, free=60)
    gate = make_gate(probe, metrics, clock, policy="working_set", wait_poll_sec=60)
    probe.set_prefix("owner", total=50, hit=0)
    (await gate.acquire("owner", "chat", body("owner"))).release()
    probe.set_prefix("cold", total=30, hit=0)
    task = asyncio.create_task(gate.acquire("cold", "chat", body("cold")))
    await until(lambda: waiting(gate) == 1)
    gate.finish_session("owner")
    assert sample(metrics, "kvgate_session_supersessions_count") == 1
    lease = await task
    assert lease.reason == "window_fits"
    gate.finish_session("never-seen")  # unknown: a no-op
    gate.finish_session("cold")  # in flight: ends when its lease is released
    assert gate.counts()["sessions"] == 1
    lease.release()
    assert gate.counts() == CLEAN  # ended at once, no grace wait
    assert_clean(gate, clock)


async def test_max_wait_raises_timeout_with_retry_after(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, max_wait_sec=5, wait_poll_sec=1)
    probe.usage_value = HIGH
    task = asyncio.create_task(gate.acquire("cold", "chat", body("cold")))
    await until(lambda: waiting(gate) == 1)
    for _ in range(4):  # four polls, each decides to wait again
        calls = probe.usage_calls
        clock.advance(1)
        await until(lambda calls=calls: probe.usage_calls > calls, "the waiter to poll")
    assert not task.done()
    clock.advance(2)
    with pytest.raises(AdmissionTimeout) as info:
        await task
    assert (info.value.status, info.value.code, info.value.retry_after) == (503, "admission_timeout", 1)
    assert "max_wait_sec" in info.value.message
    assert_clean(gate, clock)


async def test_newer_attempt_supersedes_the_waiting_one(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, wait_poll_sec=60)
    probe.usage_value = HIGH
    older = asyncio.create_task(gate.acquire("s1", "chat", body("s1")))
    await until(lambda: waiting(gate) == 1)
    newer = asyncio.create_task(gate.acquire("s1", "chat", body("s1")))
    with pytest.raises(AdmissionSuperseded) as info:
        await older
    assert (info.value.status, info.value.code) == (409, "admission_superseded")
    await until(lambda: waiting(gate) == 1)
    assert gate.state()["sessions"]["s1"]["num_superseded"] == 1
    assert sample(metrics, "kvgate_superseded_attempts_total", replica="r0") == 1
    probe.usage_value = LOW
    probe.set_prefix("s1", total=4, hit=4)
    gate.state()
    assert not newer.done()
    # wake through an open admission of another session
    (await gate.acquire("other", "chat", body("other"))).release()
    (await newer).release()
    assert_clean(gate, clock)
    assert sample(metrics, "kvgate_session_supersessions_sum") == 1


async def test_supersession_checkpoint_after_a_probe(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock)
    probe.hold = asyncio.Event()
    older = asyncio.create_task(gate.acquire("s1", "chat", body("s1")))
    await until(lambda: probe.usage_calls == 1, "the older attempt to be inside its probe")
    newer = asyncio.create_task(gate.acquire("s1", "chat", body("s1")))
    await until(lambda: probe.usage_calls == 2)
    probe.hold.set()
    with pytest.raises(AdmissionSuperseded):
        await older
    lease = await newer
    assert lease.reason == "open"
    lease.release()
    assert_clean(gate, clock)


async def test_retry_storm_leaves_at_most_one_waiter(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, wait_poll_sec=60)
    holder = await gate.acquire("busy", "chat", body("busy"))
    probe.usage_value = HIGH
    tasks = []
    for _ in range(300):
        tasks.append(asyncio.create_task(gate.acquire("storm", "chat", body("storm"))))
        await asyncio.sleep(0)
        assert waiting(gate) <= 1
    await until(lambda: sum(t.done() for t in tasks) == 299, "all but the newest attempt to end")
    assert waiting(gate) == 1 and gate.counts()["attempts"] == 1
    assert all(isinstance(t.exception(), AdmissionSuperseded) for t in tasks[:-1])
    assert gate.state()["sessions"]["storm"]["num_superseded"] == 299
    assert sample(metrics, "kvgate_superseded_attempts_total", replica="r0") == 299
    probe.set_prefix("storm", total=10, hit=10)  # its prefix became resident (shared with another session)
    clock.advance(HELD_READING_MAX_AGE_SEC)  # its cold reading is too old to hold it on
    holder.release()  # a release wakes the head waiter: the newest attempt
    lease = await tasks[-1]
    assert lease.reason == "resident_prefix"
    lease.release()
    gate.finish_session("storm")
    assert sample(metrics, "kvgate_session_supersessions_sum") == 299
    assert_clean(gate, clock)


async def test_cancelled_waiter_leaves_nothing(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, wait_poll_sec=60)
    probe.usage_value = HIGH
    task = asyncio.create_task(gate.acquire("gone", "chat", body("gone")))
    await until(lambda: waiting(gate) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    counts = gate.counts()
    assert (counts["waiters"], counts["attempts"], counts["leases"], counts["windows"]) == (0, 0, 0, 0)
    assert sample(metrics, "kvgate_waiters", replica="r0") == 0
    assert_clean(gate, clock)


async def test_cancelled_during_probe_leaves_nothing(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock)
    probe.hold = asyncio.Event()
    task = asyncio.create_task(gate.acquire("gone", "chat", body("gone")))
    await until(lambda: probe.usage_calls == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.counts()["attempts"] == 0
    probe.hold.set()
    assert_clean(gate, clock)


async def test_shadow_mode_records_decisions_and_never_holds(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, mode="shadow")
    probe.usage_value = HIGH
    cold = await gate.acquire("cold", "chat", body("cold"))
    assert cold.reason == "shadow_wait"
    probe.set_prefix("hot", total=10, hit=10)
    hot = await gate.acquire("hot", "chat", body("hot"))
    assert hot.reason == "shadow_resident_prefix"
    hot.release()
    again = await gate.acquire("hot", "chat", body("hot"))
    assert again.reason == "shadow_holds_window"  # windows are tracked as enforce would
    for lease in (cold, again):
        lease.release()
    assert sample(metrics, "kvgate_admissions_total", replica="r0", reason="shadow_wait") == 1
    assert_clean(gate, clock)


async def test_shadow_mode_does_not_reject_too_long_prompts(metrics, clock):
    probe = FakeProbe(usage=0.1, total=100, free=100)
    gate = make_gate(probe, metrics, clock, mode="shadow", policy="working_set")
    probe.set_prefix("huge", total=500, hit=0)
    lease = await gate.acquire("huge", "chat", body("huge"))
    assert lease.reason == "shadow_prompt_too_long"
    lease.release()
    assert_clean(gate, clock)


async def test_off_mode_admits_open_without_probing(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, mode="off")
    probe.usage_value = HIGH
    lease = await gate.acquire("s1", "chat", body("s1"))
    assert lease.reason == "open" and probe.usage_calls == 0
    assert gate.counts() == {**CLEAN, "leases": 1}
    lease.release()
    assert_clean(gate, clock)


async def test_working_set_prompt_too_long_raises_400_and_leaves_nothing(metrics, clock):
    probe = FakeProbe(usage=0.1, total=100, free=100)
    gate = make_gate(probe, metrics, clock, policy="working_set")
    probe.set_prefix("huge", total=101, hit=0)
    with pytest.raises(PromptTooLong) as info:
        await gate.acquire("huge", "chat", body("huge"))
    assert (info.value.status, info.value.code) == (400, "prompt_too_long")
    assert gate.counts()["attempts"] == 0
    assert_clean(gate, clock)


async def test_closed_gate_fails_waiters_and_still_takes_releases(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, wait_poll_sec=60)
    holder = await gate.acquire("busy", "chat", body("busy"))
    probe.usage_value = HIGH
    waiters = [asyncio.create_task(gate.acquire(s, "chat", body(s))) for s in ("a", "b")]
    anonymous = asyncio.create_task(gate.acquire(None, "chat", body("x")))
    await until(lambda: waiting(gate) == 3)
    gate.close("replica r0 was removed")
    for task in (*waiters, anonymous):
        with pytest.raises(ReplicaUnavailable) as info:
            await task
        assert info.value.status == 503
    with pytest.raises(ReplicaUnavailable):
        await gate.acquire("late", "chat", body("late"))
    holder.release()
    assert gate.counts() == CLEAN


async def test_wait_poll_re_evaluates_without_any_wake(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock, wait_poll_sec=0.25)
    probe.usage_value = HIGH
    task = asyncio.create_task(gate.acquire("cold", "chat", body("cold")))
    await until(lambda: waiting(gate) == 1, "the turn to wait")
    for polls in (2, 3):
        clock.advance(0.25)
        await until(lambda polls=polls: probe.usage_calls >= polls, "the waiter to poll")
    assert probe.prefix_calls == ["cold"]  # decided again on its last reading: no new probe
    probe.usage_value = LOW
    clock.advance(0.25)
    lease = await task
    assert lease.reason == "open"
    lease.release()
    assert_clean(gate, clock)


async def test_concurrent_turns_of_one_session_share_the_window(probe, metrics, clock):
    gate = make_gate(probe, metrics, clock)
    probe.usage_value = HIGH
    probe.set_prefix("s1", total=10, hit=10)
    first = await gate.acquire("s1", "chat", body("s1"))
    second = await gate.acquire("s1", "chat", body("s1"))  # admitted: not a waiting attempt
    assert (first.reason, second.reason) == ("resident_prefix", "holds_window")
    first.release()
    assert gate.state()["windows"] == {"in_flight": ["s1"], "idle": []}
    second.release()
    assert gate.state()["windows"] == {"in_flight": [], "idle": ["s1"]}
    assert_clean(gate, clock)


def test_unknown_mode_is_rejected(probe, metrics, clock):
    with pytest.raises(ValueError, match="unknown gate.mode 'hold'"):
        make_gate(probe, metrics, clock, mode="hold")
