"""The working_set policy in the asyncio gate: a working set priced by the gate's own books.

Fake clock, fake probe, no real waits: `wait_poll_sec` is 60 s, so every admission of a
waiter below comes from a wake-up (a finish, a lost or shrunk window, a waiter leaving),
never from polling. Every test ends with nothing left.
"""

from __future__ import annotations

import asyncio

import pytest

from kvgate.gate.errors import PromptTooLong
from kvgate.gate.gate import Gate, Lease
from tests.gate.helpers import FakeProbe, assert_clean, body, sample, settings, until

# Logic tests: the gate's timers run on the fake clock (see conftest.loop_on_clock).
pytestmark = pytest.mark.usefixtures("loop_on_clock")


def working_set_gate(metrics, clock, total: int = 100, free: int = 100, **overrides) -> tuple[Gate, FakeProbe]:
    """A working_set gate on a replica of `total` blocks (headroom 0: all usable), `free` of them
    free. The books alone decide: the engine has measured its prefill throughput (so no turn
    goes in unpriced) but reports no block size, so the work-conserving rule cannot price
    a hold."""
    probe = FakeProbe(usage=0.1, total=total, free=free, prefill_tokens_per_sec=1600.0)
    gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60, **overrides), metrics, clock)
    return gate, probe


def unbounded_body(session: str, size: int = 2000, **fields) -> dict:
    """A body whose byte-length bound on its prompt (over `size` tokens; 2,000: 125
    blocks of 16) exceeds a 100-block replica, so the working_set policy must probe to
    price it. A later turn of the same session must grow by as many bytes as it grows
    in tokens, or more (as real prompts do), else its history bound fits."""
    return body(session, "x" * size, **fields)


def window_price(gate: Gate, session: str) -> int:
    """The session's window price in blocks, as /admin/state shows it."""
    return gate.state()["sessions"][session]["footprint_blocks"]


def waiting(gate: Gate) -> int:
    return gate.counts()["waiters"]


async def turn(gate: Gate, probe: FakeProbe, session: str, blocks: int, hit: int = 0) -> Lease:
    """Admit one turn of `session` whose prompt is `blocks` blocks (`hit` resident) at once."""
    probe.set_prefix(session, total=blocks, hit=hit)
    return await gate.acquire(session, "chat", body(session))


async def admitted(task: asyncio.Task) -> Lease:
    """The task's lease, which a wake-up must deliver within `until`'s budget (no 60 s poll)."""
    await until(task.done, "a wake-up to admit the waiter")
    return task.result()


async def drain(gate: Gate, tasks: dict[str, asyncio.Task]) -> None:
    """Finish sessions as their turns are admitted until every task has a released lease."""
    finished: set[str] = set()
    while len(finished) < len(tasks):
        await until(lambda: any(t.done() for s, t in tasks.items() if s not in finished), "another admission")
        for session, task in tasks.items():
            if task.done() and session not in finished:
                task.result().release()
                gate.finish_session(session)
                finished.add(session)


async def test_burst_of_eight_on_a_cache_for_three_admits_three_and_holds_five(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    names = [f"s{i}" for i in range(8)]
    for name in names:
        probe.set_prefix(name, total=30, hit=0)  # 30 blocks each: three fit 100, four do not
    tasks = {name: asyncio.create_task(gate.acquire(name, "chat", body(name))) for name in names}
    await until(lambda: waiting(gate) == 5, "five sessions to wait")
    assert [name for name, task in tasks.items() if task.done()] == ["s0", "s1", "s2"]
    assert {tasks[name].result().reason for name in ("s0", "s1", "s2")} == {"window_fits"}
    state = gate.state()
    assert state["windows"]["in_flight"] == ["s0", "s1", "s2"] and state["window_blocks"] == 90
    # vLLM read 100 free blocks for every one of them: the books, not vLLM, stopped the fourth.
    # The head waiter was probed; the four behind it wait their turn unprobed (strict FIFO).
    assert probe.prefix_calls == ["s0", "s1", "s2", "s3"]
    assert sample(metrics, "kvgate_waiters", replica="r0") == 5
    # /admin/state says why each waits: the head does not fit beside the windows, the rest queue behind it
    held = {name: state["sessions"][name]["held"] for name in names}
    assert held["s0"] is None and held["s3"]["cause"] == "windows_full" and "90 in windows" in held["s3"]["why"]
    assert {held[name]["cause"] for name in ("s4", "s5", "s6", "s7")} == {"behind_waiters"}

    # The oldest finishes its turn: its window stays (idle), so the head still does not fit.
    # It decides again on its last prefix reading: hits only fall while a turn waits, so
    # a reading that held it still does, and it is not probed again.
    usage_calls = probe.usage_calls
    tasks["s0"].result().release()
    await until(lambda: probe.usage_calls > usage_calls, "the head to re-decide")
    await until(lambda: gate.state()["sessions"]["s3"]["held"] is not None, "the head to wait again")
    assert waiting(gate) == 5 and len(probe.prefix_calls) == 4
    # The oldest finishes its session: its 30 blocks come back. On its last reading the head
    # would be admitted now, so it is priced on a fresh probe, and admitted.
    gate.finish_session("s0")
    lease = await admitted(tasks["s3"])
    assert lease.reason == "window_fits" and probe.prefix_calls == ["s0", "s1", "s2", "s3", "s3"]
    await until(lambda: len(probe.prefix_calls) == 6, "the next waiter to re-decide")  # woken by s3's admission
    assert waiting(gate) == 4 and sum(task.done() for task in tasks.values()) == 4
    assert gate.state()["windows"]["in_flight"] == ["s1", "s2", "s3"]

    del tasks["s0"]
    await drain(gate, tasks)
    assert_clean(gate, clock)


async def test_owner_whose_growth_no_longer_fits_loses_its_window_and_waits(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    (await turn(gate, probe, "old", 50)).release()
    (await turn(gate, probe, "young", 40)).release()
    assert gate.state()["windows"]["idle"] == ["old", "young"]

    # young grows to 60: behind old's 50 that is 110 > 100. It must not keep its window while it waits.
    task = asyncio.create_task(turn(gate, probe, "young", 60, hit=40))
    await until(lambda: waiting(gate) == 1, "young to wait")
    state = gate.state()
    assert state["windows"] == {"in_flight": [], "idle": ["old"]} and state["window_blocks"] == 50
    assert state["waiters"] == ["young"]
    assert state["sessions"]["young"]["has_window"] is False and state["sessions"]["young"]["windows_lost"] == 1

    # old grows too and still passes: nothing ranks before it, whoever waits.
    lease = await turn(gate, probe, "old", 55)
    assert lease.reason == "holds_window" and gate.state()["sessions"]["old"]["footprint_blocks"] == 55
    assert not task.done()
    gate.finish_session("old")  # in flight: the window ends now, the record after the release
    young = await admitted(task)
    assert young.reason == "window_fits"  # back as a newcomer, with a new window
    assert gate.state()["windows"]["in_flight"] == ["young"]
    for held in (lease, young):
        held.release()
    gate.finish_session("young")
    assert_clean(gate, clock)


async def test_a_session_that_lost_its_window_keeps_its_place_ahead_of_younger_sessions(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    (await turn(gate, probe, "a", 50)).release()
    (await turn(gate, probe, "b", 40)).release()
    newcomer = asyncio.create_task(turn(gate, probe, "c", 20))  # 90 + 20 > 100
    await until(lambda: waiting(gate) == 1)
    loser = asyncio.create_task(turn(gate, probe, "b", 60))  # 50 + 60 > 100: b loses its 40 blocks
    await until(lambda: waiting(gate) == 2)
    # b started before c: it queues ahead, and c gets no window before it (50 + 20 would fit)
    assert gate.state()["waiters"] == ["b", "c"] and not newcomer.done()
    gate.finish_session("a")  # 60 + 20 fits: b first, then c
    lease_b, lease_c = await admitted(loser), await admitted(newcomer)
    assert lease_b.reason == lease_c.reason == "window_fits"
    assert gate.state()["windows"]["in_flight"] == ["b", "c"]
    for session, held in (("c", lease_c), ("b", lease_b)):
        held.release()
        gate.finish_session(session)
    assert_clean(gate, clock)


async def test_a_shrinking_footprint_wakes_a_waiter(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    (await turn(gate, probe, "owner", 60)).release()
    task = asyncio.create_task(turn(gate, probe, "cold", 50))  # 60 + 50 > 100
    await until(lambda: waiting(gate) == 1)
    owner = await turn(gate, probe, "owner", 40)  # e.g. its context was compacted
    assert owner.reason == "holds_window"
    cold = await admitted(task)
    assert cold.reason == "window_fits"
    for session, held in (("owner", owner), ("cold", cold)):
        held.release()
        gate.finish_session(session)
    assert_clean(gate, clock)


async def test_newcomers_queue_in_fifo_order_and_a_head_that_leaves_wakes_the_next(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    holder = await turn(gate, probe, "holder", 70)
    big = asyncio.create_task(turn(gate, probe, "big", 40))  # 70 + 40 > 100
    await until(lambda: waiting(gate) == 1)
    small = asyncio.create_task(turn(gate, probe, "small", 10))  # would fit, but big came first
    await until(lambda: waiting(gate) == 2)
    assert probe.prefix_calls == ["holder", "big"]  # small is not probed while it waits behind big
    big.cancel()  # the client of big went away
    with pytest.raises(asyncio.CancelledError):
        await big
    lease = await admitted(small)
    assert lease.reason == "window_fits"
    for session, held in (("holder", holder), ("small", lease)):
        held.release()
        gate.finish_session(session)
    assert_clean(gate, clock)


async def test_owners_are_probed_every_turn_and_priced_with_their_output_allowance(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    probe.block_size = 16
    probe.set_prefix("s1", total=20, hit=0, tokens=330)
    first = await gate.acquire("s1", "chat", unbounded_body("s1", max_tokens=22))  # ceil((330 + 22) / 16) = 22
    assert first.reason == "window_fits" and gate.state()["sessions"]["s1"]["footprint_blocks"] == 22
    first.release()
    probe.set_prefix("s1", total=25, hit=20, tokens=410)
    second = await gate.acquire("s1", "chat", unbounded_body("s1", 4000, max_completion_tokens=30, max_tokens=1))
    assert second.reason == "holds_window"
    # its prompt and the request's allowance (the newer field), not how much it grew: ceil((410 + 30) / 16) = 28
    assert gate.state()["sessions"]["s1"]["footprint_blocks"] == 28
    assert probe.prefix_calls == ["s1", "s1"]
    second.release()
    gate.finish_session("s1")
    assert_clean(gate, clock)


async def test_an_owner_whose_prompt_outgrew_the_cache_is_rejected_and_loses_its_window(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    (await turn(gate, probe, "s1", 90)).release()
    with pytest.raises(PromptTooLong):
        await turn(gate, probe, "s1", 101)
    assert gate.counts()["windows"] == 0 and gate.state()["window_blocks"] == 0
    assert_clean(gate, clock)


async def test_without_block_counts_working_set_falls_back_to_watermark(metrics, clock):
    probe = FakeProbe(usage=0.9)  # the /metrics fallback: usage only
    gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60), metrics, clock)
    probe.set_prefix("hot", total=10, hit=10)
    lease = await gate.acquire("hot", "chat", body("hot"))
    assert lease.reason == "resident_prefix"
    lease.release()
    again = await gate.acquire("hot", "chat", body("hot"))
    assert again.reason == "holds_window" and probe.prefix_calls == ["hot"]  # seed: owners unprobed
    again.release()
    assert_clean(gate, clock)


async def test_shadow_mode_drops_a_window_as_enforce_would(metrics, clock):
    gate, probe = working_set_gate(metrics, clock, mode="shadow")
    (await turn(gate, probe, "a", 60)).release()
    (await turn(gate, probe, "b", 30)).release()
    lease = await turn(gate, probe, "b", 50)  # 60 + 50 > 100: enforce would take the window and hold it
    assert lease.reason == "shadow_wait"
    assert gate.state()["windows"]["in_flight"] == [] and gate.state()["windows"]["idle"] == ["a"]
    lease.release()
    assert_clean(gate, clock)


async def test_windows_are_priced_at_their_size_not_at_their_sessions_growth(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    probe.block_size = 16
    probe.set_prefix("a", total=20, hit=0, tokens=320)
    first = await gate.acquire("a", "chat", unbounded_body("a"))
    assert gate.state()["sessions"]["a"]["footprint_blocks"] == 20
    first.release()
    probe.set_prefix("a", total=40, hit=20, tokens=640)
    second = await gate.acquire("a", "chat", unbounded_body("a", 4000))  # grew 320 tokens: still its 40 blocks
    assert second.reason == "holds_window"
    assert gate.state()["sessions"]["a"]["footprint_blocks"] == 40 and gate.state()["window_blocks"] == 40
    second.release()

    # b's first turn is 40 blocks: 40 + 40 fits the 100, whatever a or b will grow by.
    probe.set_prefix("b", total=40, hit=0, tokens=640)
    lease = await gate.acquire("b", "chat", unbounded_body("b"))
    assert lease.reason == "window_fits" and gate.state()["sessions"]["b"]["footprint_blocks"] == 40
    assert gate.state()["window_blocks"] == 80
    lease.release()
    gate.finish_session("a")
    gate.finish_session("b")
    assert_clean(gate, clock)


async def test_a_turn_whose_upper_bound_fits_is_admitted_at_once_and_repriced_beside_it(metrics, clock):
    """No pressure: the body's byte-length bound (a short chat: about 600 tokens, 38
    blocks of 16) fits the idle 70-block replica, so the turn is admitted without
    waiting for a probe, priced at the bound; as the windows now hold over half the
    cache, the exact price arrives from a probe run beside the forwarded turn. Once the
    older windows leave no room for a bound, the exact price is probed before deciding."""
    gate, probe = working_set_gate(metrics, clock, total=70, free=70)
    probe.block_size = 16

    probe.set_prefix("s1", total=4, hit=0, tokens=70)
    first = await gate.acquire("s1", "chat", body("s1"))
    assert first.reason == "window_fits" and probe.prefix_calls == []
    assert 36 <= window_price(gate, "s1") <= 40 and gate.state()["repricing"] == 1  # the probe runs beside it
    await until(lambda: window_price(gate, "s1") == 5, "the exact price (ceil(70 / 16))")
    await until(lambda: gate.state()["repricing"] == 0, "the repricing probe to end")
    assert probe.prefix_calls == ["s1"]
    first.release()

    probe.set_prefix("big", total=60, hit=0, tokens=960)
    big = await gate.acquire("big", "chat", unbounded_body("big"))  # its bound never fits: probed first
    assert big.reason == "window_fits" and window_price(gate, "big") == 60 and probe.prefix_calls == ["s1", "big"]
    probe.set_prefix("s2", total=1, hit=0, tokens=20)
    second = await gate.acquire("s2", "chat", body("s2"))  # 38 + 65 > 70: priced before deciding
    assert (
        second.reason == "window_fits" and probe.prefix_calls == ["s1", "big", "s2"] and window_price(gate, "s2") == 2
    )
    for lease, session in ((big, "big"), (second, "s2")):
        lease.release()
        gate.finish_session(session)
    gate.finish_session("s1")
    assert_clean(gate, clock)


async def test_a_bounded_window_is_not_repriced_while_the_windows_hold_under_half_the_cache(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)  # 100 blocks: one 38-block bound is under half
    probe.block_size = 16
    lease = await gate.acquire("s1", "chat", body("s1"))
    for _ in range(5):
        await asyncio.sleep(0)  # a background re-price, had one been started, would run now
    assert lease.reason == "window_fits" and probe.prefix_calls == []
    lease.release()
    gate.finish_session("s1")
    assert_clean(gate, clock)


async def test_media_bodies_are_always_priced_by_the_probe(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    probe.block_size = 16
    probe.set_prefix("m", total=30, hit=0, tokens=480)
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}
    lease = await gate.acquire("m", "chat", {"id": "m", "messages": [image]})
    assert lease.reason == "window_fits" and probe.prefix_calls == ["m"]
    lease.release()
    gate.finish_session("m")
    assert_clean(gate, clock)


async def learned_gate(metrics, clock) -> tuple[Gate, FakeProbe]:
    """A 70-block working_set gate after one turn of s1 (70 tokens) whose usage it learned:
    the turn was repriced by a probe beside it (no usage learned before it), its window
    is priced at 5 blocks."""
    gate, probe = working_set_gate(metrics, clock, total=70, free=70)
    probe.block_size = 16
    probe.set_prefix("s1", total=4, hit=0, tokens=70)
    first = await gate.acquire("s1", "chat", body("s1"))
    await until(lambda: probe.prefix_calls == ["s1"], "the repricing probe: nothing learned yet")
    first.learn(70, 0)
    first.release()
    return gate, probe


async def test_a_turns_usage_prices_its_window_and_spares_the_repricing_probe(metrics, clock):
    """The replica reports each served turn's prompt (`Lease.learn`): the window priced at
    its bound gets its exact price when the turn ends, and a later bound-priced turn is not
    repriced by a probe beside it while no turn waits; a turn with no learned usage before
    it still is (the first one here)."""
    gate, probe = await learned_gate(metrics, clock)
    assert window_price(gate, "s1") == 5  # ceil(70 / 16)

    second = await gate.acquire("s2", "chat", body("s2"))  # 38 blocks at its bound: over half of 70
    assert second.reason == "window_fits" and 36 <= window_price(gate, "s2") <= 40
    for _ in range(5):
        await asyncio.sleep(0)  # a repricing probe, had one been started, would run now
    assert probe.prefix_calls == ["s1"]
    second.learn(100, 32)  # 100 tokens, 2 blocks of them cached
    assert window_price(gate, "s2") == 7  # ceil(100 / 16)
    second.release()
    assert window_price(gate, "s2") == 7
    for session in ("s1", "s2"):
        gate.finish_session(session)
    assert_clean(gate, clock)


async def test_a_turns_learned_hits_count_its_reprefill_without_a_probe(metrics, clock):
    """A turn admitted without a prefix reading (its bound fits) still counts the tokens
    it prefilled again, from its usage: its previous turn's full blocks that its
    `cached_tokens` do not cover."""
    gate, probe = working_set_gate(metrics, clock)
    probe.block_size = 16
    for prompt, cached in ((320, 0), (400, 160)):
        lease = await gate.acquire("s", "chat", body("s"))
        lease.learn(prompt, cached)
        lease.release()
    assert probe.prefix_calls == []
    # the previous prompt's 20 full blocks, 10 of them cached: 10 blocks computed again
    assert sample(metrics, "kvgate_reprefill_tokens_estimated_total", replica="r0") == 160
    gate.finish_session("s")
    assert_clean(gate, clock)


async def test_a_turn_repriced_beside_itself_counts_no_reprefill_of_its_own_prompt(metrics, clock):
    """A session's first turn, repriced by a probe beside it (nothing learned yet), then
    learned from its usage: the probe recorded the turn's own size, which is not a
    previous prompt, so the turn re-prefills nothing; the next turn, with nothing
    cached, re-prefills the first one's full blocks."""
    gate, _ = await learned_gate(metrics, clock)  # s1: 70 tokens, repriced by a probe, usage 0 cached
    assert sample(metrics, "kvgate_reprefill_tokens_estimated_total", replica="r0") == 0
    second = await gate.acquire("s1", "chat", body("s1"))
    second.learn(90, 0)
    second.release()
    assert sample(metrics, "kvgate_reprefill_tokens_estimated_total", replica="r0") == 64  # 70 // 16 blocks
    gate.finish_session("s1")
    assert_clean(gate, clock)


async def test_a_window_left_to_its_usage_is_probed_once_a_turn_waits(metrics, clock):
    """A window priced at its bound whose repricing was left to its turn's usage gets its
    exact price from a probe as soon as another turn must wait: over-priced windows may
    be what holds it, and a long turn's usage comes too late."""
    gate, probe = await learned_gate(metrics, clock)
    probe.set_prefix("s2", total=2, hit=0, tokens=40)
    second = await gate.acquire("s2", "chat", body("s2"))  # at its bound (~38 blocks), left to its usage
    for _ in range(5):
        await asyncio.sleep(0)
    assert probe.prefix_calls == ["s1"]
    probe.set_prefix("big", total=60, hit=0, tokens=960)
    big = asyncio.create_task(gate.acquire("big", "chat", unbounded_body("big")))  # 60 + 5 + 38 > 70: waits
    await until(lambda: "s2" in probe.prefix_calls, "the waiting turn to get s2 repriced")
    lease = await admitted(big)  # s2's exact price (3 blocks) lets it in
    assert lease.reason == "window_fits"
    for held, session in ((second, "s2"), (lease, "big")):
        held.release()
        gate.finish_session(session)
    gate.finish_session("s1")
    assert_clean(gate, clock)


async def test_a_turn_of_a_session_that_started_earlier_queues_ahead_of_a_younger_sessions(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    (await turn(gate, probe, "old", 30)).release(served=False)  # its upstream failed: no window kept
    clock.advance(5.0)
    assert gate.counts()["windows"] == 0 and "old" in gate.state()["sessions"]  # the gate still knows old
    holder = await turn(gate, probe, "holder", 70)
    young = asyncio.create_task(turn(gate, probe, "young", 70))  # 70 + 70 > 100
    await until(lambda: waiting(gate) == 1)
    clock.advance(2.0)
    old = asyncio.create_task(turn(gate, probe, "old", 40))  # 70 + 40 > 100, and old started first
    await until(lambda: waiting(gate) == 2)
    assert [w["session"] for w in gate.waiters()] == ["old", "young"]
    assert gate.oldest_waiter_age() == pytest.approx(2.0)  # young's: the longest queued, not the head
    holder.release()
    gate.finish_session("holder")
    lease_old = await admitted(old)  # 40 fits; 40 + 70 does not: young waits for old to finish
    assert lease_old.reason == "window_fits" and not young.done()
    lease_old.release()
    gate.finish_session("old")
    lease_young = await admitted(young)
    lease_young.release()
    gate.finish_session("young")
    assert_clean(gate, clock)


async def test_a_holder_at_its_upper_bound_does_not_crowd_a_younger_window_out(metrics, clock):
    """A window priced at its body's upper bound is over-priced (a token per byte), and
    windows rank by when they opened: the oldest holder's bound would fit behind the
    older windows (none) but not beside the younger one, whose session would lose its
    window at its next turn. So the holder is probed and priced exactly, and the younger
    session keeps its window."""
    probe = FakeProbe(usage=0.1, total=100, free=100, block_size=16, prefill_tokens_per_sec=1600.0)
    gate = Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60), metrics, clock)
    first = await gate.acquire("old", "chat", body("old", "hello", max_tokens=16))  # its bound fits: no probe
    first.learn(8, 0)
    first.release()
    probe.set_prefix("young", total=60, hit=0, tokens=60 * 16)
    young = await gate.acquire("young", "chat", unbounded_body("young", max_tokens=16))
    assert (young.reason, window_price(gate, "young")) == ("window_fits", 61)
    young.release()
    # 700 bytes more: bounded at 8 + 700 + 64 tokens + 16 of output, 50 blocks; 50 + 61 > 100
    probe.set_prefix("old", total=5, hit=1, tokens=5 * 16)
    again = await gate.acquire("old", "chat", body("old", "hello" + "x" * 700, max_tokens=16))
    assert again.reason == "holds_window" and "old" in probe.prefix_calls
    assert window_price(gate, "old") == 6  # 80 + 16 tokens
    again.release()
    probe.set_prefix("young", total=62, hit=60, tokens=62 * 16)
    grown = await gate.acquire("young", "chat", unbounded_body("young", size=2100, max_tokens=16))
    assert grown.reason == "holds_window"  # 63 + 6 <= 100; beside a 50-block bound it would have lost it
    grown.release()
    for session in ("old", "young"):
        gate.finish_session(session)
    assert_clean(gate, clock)


async def test_a_cap_far_above_the_replies_is_priced_at_the_replicas_recent_replies(metrics, clock):
    """Agent clients send a max_tokens far above their replies (Claude Code: 32,000). Before
    the replica's first reply a turn is priced at its cap; once usage has said how long the
    replies are, a served turn's window is priced at the reply it took, and later turns at
    the longest recent reply (never above their own cap), so a second session fits beside
    the first where two caps would not."""
    gate, probe = working_set_gate(metrics, clock, total=100, free=100)
    probe.block_size = 16
    probe.set_prefix("s1", total=4, hit=0, tokens=60)
    assert gate.state()["reply_tokens"] is None  # no reply served yet
    first = await gate.acquire("s1", "chat", body("s1", max_tokens=1024))
    assert first.reason == "window_fits" and window_price(gate, "s1") == 68  # ceil((60 + 1024) / 16)
    first.learn(60, 0, 8)
    assert window_price(gate, "s1") == 5  # ceil((60 + 8) / 16): the reply it took
    first.release()

    probe.set_prefix("s2", total=4, hit=0, tokens=60)
    second = await gate.acquire("s2", "chat", body("s2", max_tokens=1024))
    assert second.reason == "window_fits" and window_price(gate, "s2") < 68  # at its cap it would not fit
    second.learn(60, 0, 30)
    second.release()
    assert gate.state()["reply_tokens"] == 30  # the longest recent reply, as /admin/state shows it
    assert gate._book.output_price(1024) == 30 and gate._book.output_price(20) == 20  # never above the cap
    assert gate._book.output_price(0) == 30  # no cap given: the longest recent reply
    for session in ("s1", "s2"):
        gate.finish_session(session)
    assert_clean(gate, clock)
