"""Conflict detection, the pure parts: the replica's owner record and the gate's verdicts."""

from __future__ import annotations

import logging

import pytest

from kvgate.gate.ownership import (
    CONFLICT,
    NO_API,
    OWNER,
    UNCHECKED,
    UNKNOWN,
    Ownership,
    conflict_flag,
    gate_mode,
    next_ownership,
    readiness,
    transition_message,
)
from kvgate.wire.owner_record import OwnerAnswer, OwnerClaim, OwnerClaimError, OwnerRecord, answer, claim

INF = float("inf")


def run(steps):
    """Apply (gate_id, ttl, now) claims in order; return the answer to the last one."""
    record = OwnerRecord()
    out = None
    for gate_id, ttl, now in steps:
        record = claim(record, gate_id, ttl, now)
        out = answer(record, gate_id, now)
    return record, out


@pytest.mark.parametrize(
    "steps, owner, held, contenders",
    [
        ([("a", 10, 0)], "a", True, []),  # a free record is taken
        ([("a", 10, 0), ("a", 10, 5)], "a", True, []),  # the owner renews
        ([("a", 10, 0), ("b", 10, 5)], "a", False, ["b"]),  # a live lease refuses b
        ([("a", 10, 0), ("b", 10, 10)], "b", True, []),  # ... until it lapses (expiry is exclusive)
        ([("a", 10, 0), ("b", 10, 5), ("a", 10, 6)], "a", True, ["b"]),  # the owner learns of b on renewal
        ([("a", 10, 0), ("b", 10, 5), ("a", 10, 16)], "a", True, []),  # b's contention lapses after its ttl
        ([("a", 10, 0), ("a", 0, 1), ("b", 10, 2)], "b", True, []),  # ttl 0 releases at once
        ([("a", 10, 0), ("b", 0, 1), ("a", 10, 2)], "a", True, []),  # ttl 0 from another gate only withdraws it
        ([("a", 10, 0), ("b", 10, 1), ("b", 0, 2), ("a", 10, 3)], "a", True, []),
    ],
)
def test_owner_record_table(steps, owner, held, contenders):
    _, out = run(steps)
    assert (out.owner, out.held, list(out.contenders)) == (owner, held, contenders)


def test_owner_record_read_and_expiry_figures():
    record, _ = run([("a", 10, 0)])
    assert answer(record, None, 4).to_json() == {
        "version": 1,
        "owner": "a",
        "held": False,
        "expires_in_sec": 6.0,
        "contenders": [],
    }
    assert answer(record, None, 11).owner is None


@pytest.mark.parametrize(
    "body, param",
    [
        ([], None),
        ({"ttl_sec": 1}, "gate_id"),
        ({"gate_id": "", "ttl_sec": 1}, "gate_id"),
        ({"gate_id": "x" * 257, "ttl_sec": 1}, "gate_id"),
        ({"gate_id": "a"}, "ttl_sec"),
        ({"gate_id": "a", "ttl_sec": True}, "ttl_sec"),
        ({"gate_id": "a", "ttl_sec": -1}, "ttl_sec"),
        ({"gate_id": "a", "ttl_sec": 3601}, "ttl_sec"),
    ],
)
def test_bad_claims_name_the_field(body, param):
    with pytest.raises(OwnerClaimError) as err:
        OwnerClaim.parse(body)
    assert err.value.param == param


def test_parse_owner_answer():
    assert OwnerAnswer.parse({"owner": "a", "held": True, "expires_in_sec": 3, "contenders": ["b"]}) == OwnerAnswer(
        "a", True, 3.0, ("b",)
    )
    for bad in ([], {"held": "yes"}, {"held": True, "owner": 3}, {"held": True, "contenders": "b"}):
        with pytest.raises(ValueError):
            OwnerAnswer.parse(bad)


HELD = OwnerAnswer("me", True, 9.0)
TAKEN = OwnerAnswer("other", False, 9.0)


@pytest.mark.parametrize(
    "previous, outcome, status",
    [
        (Ownership(), HELD, OWNER),
        (Ownership(), TAKEN, CONFLICT),
        (Ownership(), NO_API, UNCHECKED),
        (Ownership(), None, UNKNOWN),  # a failed claim changes nothing ...
        (Ownership(OWNER, "me"), None, OWNER),  # ... so a slow replica never flaps the gate
        (Ownership(CONFLICT, "other"), None, CONFLICT),
        (Ownership(CONFLICT, "other"), HELD, OWNER),  # the owner's lease lapsed: take over
    ],
)
def test_next_ownership(previous, outcome, status):
    assert next_ownership(previous, outcome).status == status


@pytest.mark.parametrize(
    "configured, status, mode",
    [
        ("enforce", OWNER, "enforce"),
        ("enforce", CONFLICT, "shadow"),
        ("enforce", UNCHECKED, "enforce"),
        ("enforce", UNKNOWN, "enforce"),
        ("shadow", CONFLICT, "shadow"),
        ("off", CONFLICT, "off"),
    ],
)
def test_gate_mode(configured, status, mode):
    assert gate_mode(configured, Ownership(status, "other")) == mode


@pytest.mark.parametrize(
    "ownership, flag",
    [
        (Ownership(OWNER, "me"), 0),
        (Ownership(OWNER, "me", ("b",)), 1),
        (Ownership(CONFLICT, "other"), 1),
        (Ownership(UNCHECKED), 0),
        (Ownership(), 0),
    ],
)
def test_conflict_flag(ownership, flag):
    assert conflict_flag(ownership) == flag


def test_transition_messages_say_what_changed_once():
    conflict = Ownership(CONFLICT, "other", (), 9.0)
    level, line = transition_message("r0", "me", Ownership(), conflict)
    assert level == logging.ERROR and "other" in line and "shadow" in line and "r0" in line
    assert transition_message("r0", "me", conflict, conflict) is None
    assert transition_message("r0", "me", Ownership(), Ownership(UNCHECKED))[0] == logging.WARNING
    assert transition_message("r0", "me", Ownership(), Ownership(OWNER, "me"))[0] == logging.INFO
    assert transition_message("r0", "me", Ownership(OWNER, "me"), Ownership(OWNER, "me", ("b",)))[0] == logging.ERROR


@pytest.mark.parametrize(
    "healthy, ownership, ready, conflicts",
    [
        ({"r0": True}, {}, True, {}),
        ({"r0": False}, {}, False, {}),
        ({"r0": True}, {"r0": Ownership(CONFLICT, "other")}, False, {"r0": "other"}),
        ({"r0": True, "r1": True}, {"r0": Ownership(CONFLICT, "other")}, True, {"r0": "other"}),
        ({"r0": True}, {"r0": Ownership(UNCHECKED)}, True, {}),
    ],
)
def test_readiness(healthy, ownership, ready, conflicts):
    assert readiness(healthy, ownership) == (ready, conflicts)
