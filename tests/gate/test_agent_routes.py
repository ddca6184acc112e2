"""Anthropic messages and Responses turns in the gate: priced like chat, except that a
Responses continuation (`previous_response_id`) has no byte bound and is always probed.
Every test ends with nothing left."""

from __future__ import annotations

import pytest

from kvgate.gate.gate import Gate
from kvgate.gate.request_body import body_holds_prompt, output_allowance
from tests.gate.helpers import FakeProbe, assert_clean, settings

# Logic tests: the gate's timers run on the fake clock (see conftest.loop_on_clock).
pytestmark = pytest.mark.usefixtures("loop_on_clock")


@pytest.mark.parametrize(
    "route_kind, body, holds",
    [
        ("chat", {"messages": []}, True),
        ("messages", {"messages": [], "metadata": {"user_id": "u"}}, True),
        ("responses", {"input": "hi"}, True),
        ("responses", {"input": "hi", "previous_response_id": None}, True),
        ("responses", {"input": "hi", "previous_response_id": "resp_1"}, False),
        ("chat", {"messages": [], "previous_response_id": "resp_1"}, True),  # not a Responses field there
    ],
)
def test_body_holds_prompt(route_kind, body, holds):
    assert body_holds_prompt(route_kind, body) is holds


@pytest.mark.parametrize(
    "body, allowance",
    [
        ({"max_tokens": 7}, 7),  # chat, completion, Anthropic
        ({"max_output_tokens": 9}, 9),  # Responses
        ({"max_completion_tokens": 5, "max_output_tokens": 9}, 5),
        ({"max_output_tokens": -1}, 0),
    ],
)
def test_output_allowance_reads_each_route_field(body, allowance):
    assert output_allowance(body) == allowance


def working_set_gate(metrics, clock) -> tuple[Gate, FakeProbe]:
    probe = FakeProbe(usage=0.1, total=100, free=100, block_size=16)
    return Gate("r0", probe, settings(policy="working_set", wait_poll_sec=60), metrics, clock), probe


async def test_small_messages_and_fresh_responses_turns_skip_the_probe(metrics, clock):
    gate, probe = working_set_gate(metrics, clock)
    messages = {"id": "a", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    responses = {"id": "b", "max_output_tokens": 8, "input": "hi"}
    for session, kind, body in (("a", "messages", messages), ("b", "responses", responses)):
        lease = await gate.acquire(session, kind, body)
        assert lease.reason == "window_fits"
        lease.release()
        gate.finish_session(session)
    assert probe.prefix_calls == []
    assert_clean(gate, clock)


async def test_a_responses_continuation_is_priced_by_the_probe(metrics, clock):
    """Its body is tiny, but the replica prepends the stored conversation: only the probe knows."""
    gate, probe = working_set_gate(metrics, clock)
    probe.set_prefix("c", total=60, hit=50)
    body = {"id": "c", "max_output_tokens": 16, "input": "next", "previous_response_id": "resp_1"}
    lease = await gate.acquire("c", "responses", body)
    assert lease.reason == "window_fits"
    assert probe.prefix_calls == ["c"]
    assert gate.state()["window_blocks"] >= 60  # priced at the probed prompt, not at the 60-byte body
    lease.release()
    gate.finish_session("c")
    assert_clean(gate, clock)
