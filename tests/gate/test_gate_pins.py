"""The gate pins the windows it admits for (`gate/pins.py`, `wire.kv_pins`): a turn that
gets a window on a replica that keeps pins goes out with one, ttl the window's idle
lifetime; the pin is released, batched and off the turn's path, when the window ends,
and not before a turn of the session in flight has ended. Fake clock and probe; every
test ends clean (and with no release left unsent)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvgate.gate.gate import Gate
from kvgate.gate.pins import MIN_PIN_TTL_SEC, PinReleases, pin_session, pin_ttl, pins_pay, wants_pin
from kvgate.gate.policies.economics import evicted_window_blocks
from kvgate.gate.policies.pricing import free_budget, windows_pinned
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Wait
from kvgate.gate.policies.working_set import working_set_decide
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from kvgate.wire.kv_pins import MAX_SESSION_CHARS, Pin, make_pin
from tests.gate.helpers import FakeProbe, assert_clean, body, settings, settle, until

pytestmark = pytest.mark.usefixtures("loop_on_clock")


class PinningProbe(FakeProbe):
    """A FakeProbe of a replica that keeps pins (its kv answer reports them), recording the
    pins it proves and the releases it is sent."""

    def __init__(self, keeps_pins: bool = True, **kwargs) -> None:
        super().__init__(usage=0.9, **kwargs)
        self.keeps_pins = keeps_pins
        self.released: list[tuple[str, ...]] = []

    async def usage(self, newer_than: float | None = None) -> UsageReading | None:
        reading = await super().usage(newer_than)
        if reading is None or not self.keeps_pins:
            return reading
        return replace(reading, num_pinned_blocks=0, num_pinned_sessions=0)

    def pin(self, session: str, ttl_sec: float) -> Pin:
        return make_pin(session, ttl_sec, "replica-key")

    async def release_pins(self, sessions: tuple[str, ...]) -> None:
        self.released.append(sessions)


class SlowReleaseProbe(PinningProbe):
    """A pinning replica whose releases land when the test says (`landed` set): until then
    its free blocks still exclude the released pins' blocks, as a real engine's do while
    `POST /v1/kvgate/release` is in flight."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.landed = asyncio.Event()
        self.freed_by_release = 0

    async def release_pins(self, sessions: tuple[str, ...]) -> None:
        await self.landed.wait()
        self.free = (self.free or 0) + self.freed_by_release
        await super().release_pins(sessions)


def _gate(metrics, clock, probe: FakeProbe, **overrides) -> Gate:
    for session in ("a", "b"):
        probe.set_prefix(session, total=20, hit=18)  # resident: admitted with a window
    return Gate("r0", probe, settings(**overrides), metrics, clock)


async def test_a_window_turn_is_pinned_for_its_idle_lifetime_and_released_when_the_window_ends(metrics, clock):
    probe = PinningProbe()
    gate = _gate(metrics, clock, probe, idle_grace_sec=30.0, quiet_floor_sec=30.0, late_floor_sec=30.0)
    lease = await gate.acquire("a", "chat", body("a"))
    assert lease.pin == make_pin("a", 30.0, "replica-key")  # the late floor (= grace) here
    lease.release()
    again = await gate.acquire("a", "chat", body("a"))  # renews its window: pinned again
    assert again.reason == "holds_window" and again.pin is not None
    again.release()
    await settle()
    assert probe.released == []  # the window lives on: so does its pin
    gate.finish_session("a")
    await until(lambda: probe.released == [("a",)], "the release of a's pin")
    gate.finish_session("a")  # a second end releases nothing more
    await settle()
    assert probe.released == [("a",)]
    assert_clean(gate, clock)


async def test_no_pin_without_a_window_a_pinning_replica_or_gate_pins(metrics, clock):
    for probe, overrides in (
        (PinningProbe(keeps_pins=False), {}),  # the replica keeps no pins: the kv answer says nothing of them
        (PinningProbe(), {"pins": "off"}),
    ):
        gate = _gate(metrics, clock, probe, **overrides)
        lease = await gate.acquire("a", "chat", body("a"))
        assert lease.reason == "resident_prefix" and lease.pin is None
        lease.release()
        gate.finish_session("a")
        await settle()
        assert probe.released == []
        assert_clean(gate, clock)
    probe = PinningProbe()
    gate = _gate(metrics, clock, probe)
    lease = await gate.acquire("a", "models", {})  # a route without a prompt holds no window
    assert lease.pin is None
    lease.release()
    assert_clean(gate, clock)


async def test_every_prompt_route_is_pinned(metrics, clock):
    """vLLM takes `kv_transfer_params` on chat, completions, Anthropic messages and
    Responses alike (tests/vllm_plugin/test_pins_on_vllm.py sends a pin on the last two)."""
    probe = PinningProbe()
    gate = _gate(metrics, clock, probe)
    for route in ("chat", "completion", "messages", "responses"):
        probe.set_prefix(f"s-{route}", total=20, hit=18)  # resident: admitted with a window
        lease = await gate.acquire(f"s-{route}", route, body(f"s-{route}"))
        assert lease.pin is not None and lease.pin.session == f"s-{route}", route
        lease.release()
        gate.finish_session(f"s-{route}")
    await settle()
    assert_clean(gate, clock)


async def test_a_window_that_ends_while_its_turn_is_in_flight_is_released_after_that_turn(metrics, clock):
    probe = PinningProbe()
    gate = _gate(metrics, clock, probe)
    lease = await gate.acquire("a", "chat", body("a"))
    assert lease.pin is not None
    gate.finish_session("a")  # the window ends after the turn in flight, which pins when it ends
    await settle()
    assert probe.released == []
    lease.release()
    await until(lambda: probe.released == [("a",)], "the release after the turn")
    assert_clean(gate, clock)


async def test_a_release_that_lands_wakes_the_waiter_its_pins_held_back(metrics, clock):
    """b needs 50 new blocks; 30 are free while a's pin holds 20 more. a's session ends:
    b wakes, but the engine has not freed a's blocks yet (the release is in flight), so b
    waits again. When the release lands, b re-decides on a fresh reading and gets its
    window (the gate polls every 60 s and the clock stands still: only the release can
    have woken it)."""
    probe = SlowReleaseProbe(total=100, free=30, block_size=16)
    probe.freed_by_release = 20
    gate = Gate("r0", probe, settings(policy="working_set", headroom_blocks=0), metrics, clock)
    probe.set_prefix("a", total=20, hit=18)
    first = await gate.acquire("a", "chat", body("a"))
    assert first.reason == "window_fits" and first.pin is not None
    first.release()
    probe.set_prefix("b", total=50, hit=0)
    waiter = asyncio.create_task(gate.acquire("b", "chat", body("b")))
    await until(lambda: gate.counts()["waiters"] == 1, "b to wait")
    assert gate.state()["sessions"]["b"]["held"]["cause"] == "no_free_blocks"
    readings = probe.usage_calls
    gate.finish_session("a")  # its window ends: b re-decides, on a reading that still counts a's pin
    await until(lambda: probe.usage_calls > readings, "b to re-decide")
    await settle()
    assert not waiter.done() and gate.state()["sessions"]["b"]["held"]["cause"] == "no_free_blocks"
    probe.landed.set()
    await until(waiter.done, "the landed release to wake b")
    lease = waiter.result()
    assert lease.reason == "window_fits" and probe.released == [("a",)]
    lease.release()
    gate.finish_session("b")
    await settle()
    assert_clean(gate, clock)


async def test_releases_are_batched_and_a_new_pin_voids_a_queued_release():
    sent: list[tuple[str, ...]] = []

    async def send(sessions: tuple[str, ...]) -> None:
        sent.append(sessions)

    releases = PinReleases(send)
    for key in ("a", "b", "c"):
        releases.pinned_turn(key)
    releases.end("a")
    releases.end("b")
    releases.end("never-pinned")
    releases.pinned_turn("b")  # b's next turn goes out pinned before the release is sent
    await settle()
    assert sent == [("a",)] and releases.pinned == {"b", "c"}
    releases.close()


def test_the_pure_rules():
    usage = UsageReading(0.5, 100, 50, 16, num_pinned_blocks=0, num_pinned_sessions=0)
    assert wants_pin("auto", usage, "chat", window=True)
    assert not wants_pin("auto", usage, "chat", window=False)
    assert not wants_pin("off", usage, "chat", window=True)
    assert not wants_pin("auto", replace(usage, num_pinned_sessions=None), "chat", window=True)
    assert not wants_pin("auto", None, "completion", window=True)
    assert pin_ttl(12.5, 60.0) == 12.5 and pin_ttl(120.0, 60.0) == 60.0 and pin_ttl(0.1, 60.0) == MIN_PIN_TTL_SEC
    long_key = "k" * (MAX_SESSION_CHARS + 1)
    assert pin_session("s1") == "s1" and len(pin_session(long_key)) == 64
    Pin.parse(make_pin(pin_session(long_key), 1.0, None).to_json())  # a replica takes it


def test_no_pin_where_a_cpu_tier_holds_what_the_gpu_evicts():
    """A tier at least as large as the GPU cache brings any evicted window back by a reload:
    a pin would only choose which sessions reload, so none is sent and the policy prices
    the windows as unpinned; a smaller tier keeps pins (a window may be gone from it too)."""
    usage = UsageReading(0.5, 100, 50, 16, num_pinned_blocks=0, num_pinned_sessions=0)
    small_tier = replace(usage, num_cpu_blocks=50, cpu_load_sec_per_block=0.0001)
    large_tier = replace(small_tier, num_cpu_blocks=400)
    for tier, pinned in ((usage, True), (small_tier, True), (large_tier, False)):
        assert pins_pay(tier) is pinned
        assert wants_pin("auto", tier, "chat", window=True) is pinned
        assert windows_pinned(tier, GateSettings()) is pinned


def test_pinned_blocks_are_not_taken_off_vllms_free_blocks_twice():
    """Idle windows the replica pinned are already outside its free blocks."""
    view = WorkingSetView(idle_window_blocks=30)
    unpinned = UsageReading(0.5, 100, 50, 16)
    pinned = replace(unpinned, num_pinned_blocks=20, num_pinned_sessions=2)
    gate_settings = settings(headroom_blocks=5)
    assert free_budget(view, unpinned, gate_settings) == 50 - 30 - 5
    assert free_budget(view, pinned, gate_settings) == 50 - 10 - 5
    assert free_budget(view, replace(pinned, num_pinned_blocks=40), gate_settings) == 50 - 0 - 5


def test_with_pinned_windows_a_turn_is_held_for_the_pins_it_would_make_yield_and_its_own_prefix():
    """The prefill-bound case of test_work_conserving: 160 new blocks behind 500 blocks of
    windows on 512, a prefill-bound engine. Unpinned, the windows' 149 blocks and its own
    160 count: held. Pinned, the windows are the engine's to keep (100 free blocks,
    nothing in idle windows: no pin yields), but its own 160 blocks still count: admitted
    without a window, they are the first the engine evicts, so it is held all the same.
    A short prompt whose own re-prefill costs less than the decode slack goes in; with 60
    blocks pinned in idle windows and 100 free, what a turn takes beyond the free blocks
    comes out of them (the books' count still goes)."""
    prompt = PrefixReading(total_blocks=160, hit_blocks=0, hit_ratio=0.0, total_tokens=2560)
    view = WorkingSetView(older_window_blocks=500, idle_window_blocks=0, max_output_tokens=8, last_prompt_tokens=2400)
    unpinned = UsageReading(0.9, 512, 100, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.1, prefill_share=0.8)
    pinned = replace(unpinned, num_pinned_blocks=0, num_pinned_sessions=0)
    gate_settings = GateSettings(wait_cap_factor=0.0)
    assert isinstance(working_set_decide(view, unpinned, prompt, gate_settings), Wait)
    assert isinstance(working_set_decide(view, pinned, prompt, replace(gate_settings, pins="off")), Wait)
    assert isinstance(working_set_decide(view, pinned, prompt, gate_settings), Wait)
    # 2 blocks of its own (32 tokens: 2 ms to prefill) against 8 output tokens of 0.1 s
    # at a slack of 0.2, halved (80 ms): admitted without a window (the windows fill the
    # books: no window fits it)
    short = PrefixReading(total_blocks=2, hit_blocks=0, hit_ratio=0.0, total_tokens=32)
    full = replace(view, older_window_blocks=512)
    assert working_set_decide(full, pinned, short, gate_settings) == Admit(AdmissionReason.WORK_CONSERVING)
    idle = replace(view, idle_window_blocks=60)
    assert evicted_window_blocks(idle, pinned, prompt, 100, 512, pinned=True) == 60
    assert evicted_window_blocks(idle, pinned, prompt, 100, 512, pinned=False) == 149
    assert free_budget(idle, replace(pinned, num_pinned_blocks=60), gate_settings) == 100


async def test_a_pin_lives_while_its_session_is_expected_back_not_as_long_as_its_window(metrics, clock):
    """A session back after 3 s (its first window, of the 0.5 s floor, went quiet): its next
    window lives 4 gaps (12 s) in the gate's books, its pin
    until the session is late (3 s, its usual gap): then its blocks are the least likely to
    be read again soon, and go back to the engine's LRU order."""
    probe = PinningProbe()
    gate = _gate(metrics, clock, probe, quiet_floor_sec=0.5, late_floor_sec=0.5, quiet_factor=4.0)
    first = await gate.acquire("a", "chat", body("a"))
    assert first.pin is not None and first.pin.ttl_sec == MIN_PIN_TTL_SEC  # no gap yet: the floor, at least 1 s
    first.release()
    clock.advance(3.0)
    second = await gate.acquire("a", "chat", body("a"))
    assert second.pin is not None and second.pin.ttl_sec == 3.0
    second.release()
    assert gate.state()["sessions"]["a"]["quiet_lifetime_sec"] == 12.0  # the window outlives the pin
    assert_clean(gate, clock)


async def test_a_quick_sessions_window_ends_at_the_quiet_floor_and_its_lateness_at_the_late_floor(metrics, clock):
    """The two floors apart (by default both 0.5 s): with `quiet_floor_sec` 0.2 a session
    whose tool calls take 30 ms loses its idle window after 0.2 s (above its 4 gaps), so a
    session that ended without a word frees its blocks soon; with `late_floor_sec` 0.5 it
    is late, and its pin ends, no sooner than 0.5 s (above its gap; the pin's ttl at least
    MIN_PIN_TTL_SEC), so a capped wait reclaims no window of a session only a little slow."""
    probe = PinningProbe()
    defaults = GateSettings()
    assert (defaults.quiet_floor_sec, defaults.late_floor_sec) == (0.5, 0.5)
    gate = _gate(metrics, clock, probe, quiet_floor_sec=0.2, late_floor_sec=0.5)
    for _ in range(3):
        lease = await gate.acquire("a", "chat", body("a"))
        lease.release()
        clock.advance(0.03)
    record = gate._book.records["a"]
    assert gate._book.quiet_lifetime(record) == pytest.approx(0.2)
    assert gate._book.late_after_sec(record) == pytest.approx(0.5)
    assert lease.pin is not None and lease.pin.ttl_sec == pin_ttl(0.5, defaults.idle_grace_sec)
    clock.advance(0.2)  # idle 0.23 s: past its quiet lifetime
    assert gate.state()["windows"] == {"in_flight": [], "idle": []}
    assert gate.state()["sessions"]["a"]["last_window_end"] == "quiet"
    await until(lambda: probe.released == [("a",)], "the release of a's pin")
    assert_clean(gate, clock)
