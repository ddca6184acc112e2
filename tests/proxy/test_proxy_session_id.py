"""Session id resolution and the bounded session memory, as pure functions."""

from __future__ import annotations

from hashlib import sha256

import pytest

from kvgate.gate.session_key import MAX_SESSION_ID_BYTES, session_key
from kvgate.proxy.errors import RequestRejected
from kvgate.proxy.session_id import bounded_session_id, resolve_session_id, split_body_fields
from kvgate.proxy.session_tracker import SessionTracker

FIELDS = split_body_fields(("session_id", "prompt_cache_key", "metadata.session_id", "user"))


def resolve(path=None, headers=None, body=None):
    return resolve_session_id(path, headers or {}, "x-session-id", body, FIELDS)


def test_precedence_path_then_header_then_body_fields_in_order():
    body = {"session_id": "b1", "prompt_cache_key": "b2", "metadata": {"session_id": "b3"}, "user": "b4"}
    assert resolve("p", {"x-session-id": "h"}, body) == "p"
    assert resolve(None, {"x-session-id": "h"}, body) == "h"
    assert resolve(None, {}, body) == "b1"
    assert resolve(None, {}, {"prompt_cache_key": "b2", "user": "b4"}) == "b2"
    assert resolve(None, {}, {"metadata": {"session_id": "b3"}, "user": "b4"}) == "b3"
    assert resolve(None, {}, {"user": "b4"}) == "b4"


def test_anonymous_when_nothing_matches_and_empty_values_are_absent():
    assert resolve(None, {}, {}) is None
    assert resolve(None, {"x-session-id": ""}, {"session_id": "", "user": "u"}) == "u"
    assert resolve(None, {}, {"metadata": "not an object", "session_id": None}) is None


def test_empty_path_id_is_rejected():
    with pytest.raises(RequestRejected) as info:
        resolve("", {"x-session-id": "h"})
    assert info.value.status == 400


@pytest.mark.parametrize("body", [{"session_id": 1}, {"prompt_cache_key": True}, {"metadata": {"session_id": {}}}])
def test_non_string_field_is_rejected(body):
    with pytest.raises(RequestRejected) as info:
        resolve(None, {}, body)
    assert info.value.code == "invalid_type"


def test_long_ids_are_hashed_at_the_byte_limit():
    exact = "a" * MAX_SESSION_ID_BYTES
    assert bounded_session_id(exact) == exact
    over = exact + "a"
    assert bounded_session_id(over) == sha256(over.encode()).hexdigest()
    wide = "é" * (MAX_SESSION_ID_BYTES // 2 + 1)  # 2 bytes each: 514 bytes, 257 characters
    assert bounded_session_id(wide) == sha256(wide.encode()).hexdigest()
    assert resolve(None, {"x-session-id": over}) == resolve(over) == sha256(over.encode()).hexdigest()
    for raw in (exact, over, wide, "é" * 200, "a" * 300):  # the proxy's bound is the gate's
        assert bounded_session_id(raw) == session_key(raw)


def test_tracker_is_bounded_least_recently_used():
    tracker = SessionTracker(max_sessions=2)
    tracker.touch("a")
    tracker.touch("b")
    tracker.touch("a")  # a is now the most recent
    tracker.touch("c")  # evicts b
    assert tracker.get("b") is None
    assert tracker.get("a") is not None and tracker.get("c") is not None
    assert len(tracker) == 2


def test_tracker_forgets_idle_and_finished_sessions():
    now = [0.0]
    tracker = SessionTracker(idle_ttl_sec=10, clock=lambda: now[0])
    tracker.touch("idle").turns = 3
    tracker.touch("done").turns = 2
    now[0] = 5
    assert tracker.get("idle").turns == 3  # touching refreshes
    tracker.forget("done")
    assert tracker.get("done") is None
    now[0] = 16
    assert tracker.get("idle") is None
    assert tracker.touch("idle").turns == 0
