"""Session identity of agent clients (Claude Code, Responses chains), as pure functions."""

from __future__ import annotations

import pytest

from kvgate.proxy.errors import RequestRejected
from kvgate.proxy.response_chains import ChainLink, ResponseChains, plan_turn
from kvgate.proxy.session_id import embedded_session_id, resolve_session_id, split_body_fields
from kvgate.proxy.session_tracker import SessionTracker
from kvgate.proxy.settings import SessionSettings

DEFAULT_FIELDS = split_body_fields(SessionSettings().body_fields)
CLAUDE_CODE_JSON = '{"device_id":"d3v1ce","account_uuid":"acc-1","session_id":"5f0c-session"}'
CLAUDE_CODE_LEGACY = "user_0123abcd_account_acc-1_session_5f0c-session"


@pytest.mark.parametrize(
    "value, expected",
    [
        (CLAUDE_CODE_JSON, "5f0c-session"),
        (CLAUDE_CODE_LEGACY, CLAUDE_CODE_LEGACY),  # unique per session as it is
        ('{"device_id": "d"}', '{"device_id": "d"}'),  # no session_id inside: the value itself
        ('{"session_id": ""}', '{"session_id": ""}'),
        ('{"session_id": 7}', '{"session_id": 7}'),
        ("{not json", "{not json"),
        ('["session_id"]', '["session_id"]'),
    ],
)
def test_embedded_session_id(value, expected):
    assert embedded_session_id(value) == expected


def test_default_fields_read_claude_codes_metadata_user_id():
    body = {"model": "m", "max_tokens": 8, "messages": [], "metadata": {"user_id": CLAUDE_CODE_JSON}}
    assert resolve_session_id(None, {}, "x-session-id", body, DEFAULT_FIELDS) == "5f0c-session"
    # metadata.session_id comes first; the header before any body field
    both = {**body, "metadata": {"session_id": "explicit", "user_id": CLAUDE_CODE_JSON}}
    assert resolve_session_id(None, {}, "x-session-id", both, DEFAULT_FIELDS) == "explicit"
    assert resolve_session_id(None, {"x-session-id": "h"}, "x-session-id", body, DEFAULT_FIELDS) == "h"


def test_codex_prompt_cache_key_is_a_default_field():
    body = {"model": "m", "input": [], "prompt_cache_key": "conv-1", "store": False}
    assert resolve_session_id(None, {}, "x-session-id", body, DEFAULT_FIELDS) == "conv-1"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ids(*names):
    it = iter(names)
    return lambda: next(it)


def test_plan_of_a_first_anonymous_turn_starts_a_chain_named_by_its_response():
    plan = plan_turn({"input": "hi"}, None, lambda _id: None, ids("resp_a"))
    assert (plan.session_id, plan.link, plan.response_id, plan.set_request_id, plan.chain_session) == (
        None,
        None,
        "resp_a",
        True,
        "resp_a",
    )


def test_plan_keeps_a_client_request_id_and_an_explicit_session():
    plan = plan_turn({"input": "hi", "request_id": "resp_mine"}, "s1", lambda _id: None, ids())
    assert (plan.session_id, plan.response_id, plan.set_request_id, plan.chain_session) == (
        "s1",
        "resp_mine",
        False,
        "s1",
    )


def test_plan_of_a_continuation_takes_the_links_session_over_an_explicit_id():
    link = ChainLink("root", "replica-b", 0.0)
    plan = plan_turn({"input": "more", "previous_response_id": "resp_a"}, "other", {"resp_a": link}.get, ids("resp_b"))
    assert (plan.session_id, plan.link, plan.response_id, plan.chain_session) == ("root", link, "resp_b", "root")


def test_plan_of_an_unknown_continuation_is_the_requests_own_session():
    plan = plan_turn({"input": "x", "previous_response_id": "resp_elsewhere"}, None, lambda _id: None, ids("r"))
    assert plan.session_id is None and plan.link is None


def test_plan_of_an_unstored_response_keeps_no_link():
    plan = plan_turn({"input": "x", "store": False}, "s1", lambda _id: None, ids())
    assert (plan.session_id, plan.response_id, plan.set_request_id, plan.chain_session) == ("s1", None, False, None)


@pytest.mark.parametrize("body", [{"previous_response_id": 3}, {"request_id": ["x"]}, {"store": "no"}])
def test_plan_rejects_wrong_types(body):
    with pytest.raises(RequestRejected) as info:
        plan_turn({"input": "x", **body}, None, lambda _id: None, ids("r"))
    assert info.value.status == 400 and info.value.code == "invalid_type"


def test_chains_expire_with_the_session_idle_ttl_and_touch_on_use():
    clock = Clock()
    chains = ResponseChains(idle_ttl_sec=10, clock=clock)
    chains.record("r1", "s", "A")
    clock.now = 9
    assert chains.lookup("r1").replica == "A"  # touched at 9
    clock.now = 18
    assert chains.lookup("r1") is not None
    clock.now = 28.5
    assert chains.lookup("r1") is None and len(chains) == 0


def test_chains_are_bounded_least_recently_used():
    chains = ResponseChains(max_links=2, clock=Clock())
    chains.record("r1", "s", "A")
    chains.record("r2", "s", "A")
    chains.lookup("r1")
    chains.record("r3", "t", "B")
    assert [chains.lookup(r) is not None for r in ("r1", "r2", "r3")] == [True, False, True]
    assert len(chains) == 2


def test_finishing_a_session_or_removing_its_replica_drops_its_links():
    tracker = SessionTracker(clock=Clock())
    chains = tracker.responses
    for rid, session, replica in (("r1", "s", "A"), ("r2", "s", "A"), ("r3", "t", "B"), ("r4", "u", "A")):
        chains.record(rid, session, replica)
    tracker.forget("s")
    assert [chains.lookup(r) is not None for r in ("r1", "r2", "r3", "r4")] == [False, False, True, True]
    tracker.forget_replica("A")
    assert chains.lookup("r4") is None and chains.lookup("r3") is not None
    assert len(chains) == 1
