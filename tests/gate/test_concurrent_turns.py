"""Distinct requests of one session at once (a main turn beside a title or summary request,
parallel subagents under one session id) are all served and priced together; only a
re-sent turn (the same prompt) supersedes the waiting one. Fake clock and probe; every
test ends with nothing left."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.gate.errors import AdmissionSuperseded
from kvgate.gate.gate import Gate
from kvgate.gate.request_body import turn_key
from tests.gate.helpers import FakeProbe, assert_clean, sample, settings, until
from tests.gate.test_working_set_gate import working_set_gate

HIGH = 0.9


def request(body_id: str, text: str, **fields) -> dict:
    """A chat body; the fake probe prices it by `body_id`."""
    return {"id": body_id, "messages": [{"role": "user", "content": text}], **fields}


def waiting(gate: Gate) -> int:
    return gate.counts()["waiters"]


@pytest.mark.parametrize(
    "a, b, same",
    [
        (("chat", request("x", "hi")), ("chat", request("y", "hi", stream=True, max_tokens=5)), True),  # a retry
        (("chat", request("x", "hi")), ("chat", request("x", "a title for: hi")), False),
        (("chat", request("x", "hi")), ("completion", {"prompt": "hi"}), False),
        (("messages", {"system": "a", "messages": []}), ("messages", {"system": "b", "messages": []}), False),
        (("responses", {"input": "go", "previous_response_id": "r1"}), ("responses", {"input": "go"}), False),
    ],
)
def test_turn_key_is_the_prompt_not_the_sampling(a, b, same):
    assert (turn_key(*a) == turn_key(*b)) is same


async def test_distinct_requests_of_one_session_wait_side_by_side_and_are_all_admitted(metrics, clock):
    probe = FakeProbe(usage=HIGH)
    gate = Gate("r0", probe, settings(wait_poll_sec=60), metrics, clock)
    main = asyncio.create_task(gate.acquire("s", "chat", request("main", "fix the bug")))
    await until(lambda: waiting(gate) == 1)
    side = asyncio.create_task(gate.acquire("s", "chat", request("side", "a title for: fix the bug")))
    await until(lambda: waiting(gate) == 2, "both requests to wait")
    assert not main.done()  # not superseded by the side request
    assert gate.state()["sessions"]["s"]["attempts"] == 2
    probe.usage_value = 0.1
    (await gate.acquire("other", "chat", request("other", "hello"))).release()  # a release wakes the waiters
    leases = [await main, await side]
    assert all(lease.reason == "open" for lease in leases)
    assert sample(metrics, "kvgate_superseded_attempts_total", replica="r0") == 0
    for lease in leases:
        lease.release()
    assert gate.state()["sessions"]["s"]["num_superseded"] == 0
    assert_clean(gate, clock)


async def test_a_resent_turn_still_supersedes_beside_a_distinct_one(metrics, clock):
    probe = FakeProbe(usage=HIGH)
    gate = Gate("r0", probe, settings(wait_poll_sec=60), metrics, clock)
    first = asyncio.create_task(gate.acquire("s", "chat", request("main", "fix the bug")))
    side = asyncio.create_task(gate.acquire("s", "chat", request("side", "summarise")))
    await until(lambda: waiting(gate) == 2)
    resent = asyncio.create_task(gate.acquire("s", "chat", request("main", "fix the bug", stream=True)))
    with pytest.raises(AdmissionSuperseded):
        await first
    await until(lambda: waiting(gate) == 2, "the re-sent turn and the side request to wait")
    assert not side.done()
    assert sample(metrics, "kvgate_superseded_attempts_total", replica="r0") == 1
    probe.usage_value = 0.1
    (await gate.acquire("other", "chat", request("other", "hello"))).release()
    for task in (resent, side):
        (await task).release()
    assert_clean(gate, clock)


async def test_concurrent_turns_of_a_session_are_priced_together(metrics, clock):
    """working_set on 100 blocks: the session's main turn (30 blocks) and its side request
    (40) hold one window of 70 blocks while both are in flight, so another session's 40
    waits; when they end, it goes in."""
    gate, probe = working_set_gate(metrics, clock)
    probe.set_prefix("main", total=30, hit=0)
    probe.set_prefix("side", total=40, hit=0)
    probe.set_prefix("other", total=40, hit=0)
    main = await gate.acquire("s", "chat", request("main", "fix the bug"))
    side = await gate.acquire("s", "chat", request("side", "a title for: fix the bug"))
    state = gate.state()
    assert state["sessions"]["s"]["resident_blocks"] == 70 and state["window_blocks"] == 70
    other = asyncio.create_task(gate.acquire("o", "chat", request("other", "hello")))
    await until(lambda: waiting(gate) == 1, "the other session to wait behind both")
    main.release()
    side.release()
    gate.finish_session("s")
    (await asyncio.wait_for(other, 5)).release()
    gate.finish_session("o")
    assert_clean(gate, clock)


async def test_a_failed_turn_leaves_the_window_its_concurrent_sibling_uses(metrics, clock):
    """The turn that opened the window fails (served=False) while the session's side request
    is still in flight in it: the window stays for the sibling (a lone failed turn's window
    ends, cause revoked)."""
    gate, probe = working_set_gate(metrics, clock)
    probe.set_prefix("main", total=30, hit=0)
    probe.set_prefix("side", total=20, hit=0)
    main = await gate.acquire("s", "chat", request("main", "fix the bug"))
    side = await gate.acquire("s", "chat", request("side", "a title"))
    main.release(served=False)
    state = gate.state()
    assert state["sessions"]["s"]["has_window"] and state["windows"]["in_flight"] == ["s"]
    assert sample(metrics, "kvgate_window_ends_total", replica="r0", cause="revoked") == 0
    side.release()
    gate.finish_session("s")
    assert_clean(gate, clock)
