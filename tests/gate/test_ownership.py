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
from kvgate.wire.owner_record import (
    MAX_CONTENDERS,
    OwnerAnswer,
    OwnerBook,
    OwnerClaim,
    OwnerClaimError,
    OwnerRecord,
    answer,
    claim,
)

INF = float("inf")


def nonces():
    count = iter(range(1, 1000))
    return lambda: f"n{next(count)}"


def run(steps):
    """Apply (gate_id, ttl, now, nonce) claims in order (the nonces handed out are n1, n2, ...);
    return the record and the answer to the last one."""
    record, out, new_nonce = OwnerRecord(), None, nonces()
    for gate_id, ttl, now, nonce in steps:
        record, held = claim(record, gate_id, ttl, now, nonce, new_nonce)
        out = answer(record, now, held)
    return record, out


@pytest.mark.parametrize(
    "steps, owner, held, contenders",
    [
        ([("a", 10, 0, None)], "a", True, 0),  # a free record is taken (nonce n1)
        ([("a", 10, 0, None), ("a", 10, 5, "n1")], "a", True, 0),  # the owner renews with its nonce
        ([("a", 10, 0, None), ("b", 10, 5, None)], "a", False, 1),  # a live lease refuses b
        ([("a", 10, 0, None), ("b", 10, 10, None)], "b", True, 0),  # ... until it lapses (expiry is exclusive)
        ([("a", 10, 0, None), ("b", 10, 5, None), ("a", 10, 6, "n1")], "a", True, 1),  # a learns of b on renewal
        ([("a", 10, 0, None), ("b", 10, 5, None), ("a", 10, 16, "n1")], "a", True, 0),  # b's contention lapses
        ([("a", 10, 0, None), ("a", 0, 1, "n1"), ("b", 10, 2, None)], "b", True, 0),  # ttl 0 releases at once
        ([("a", 10, 0, None), ("b", 0, 1, None), ("a", 10, 2, "n1")], "a", True, 0),  # another's ttl 0 withdraws it
        ([("a", 10, 0, None), ("b", 10, 1, None), ("b", 0, 2, None), ("a", 10, 3, "n1")], "a", True, 0),
        # the record is the holder's: its id without the nonce neither renews nor releases it ...
        ([("a", 10, 0, None), ("a", 10, 1, None)], "a", False, 1),
        ([("a", 10, 0, None), ("a", 0, 1, None), ("b", 10, 2, None)], "a", False, 1),
        ([("a", 10, 0, None), ("a", 0, 1, "guess"), ("evil", 3600, 2, None)], "a", False, 1),
        # ... and the same id in two processes is a conflict, seen by the holder too
        ([("a", 10, 0, None), ("a", 10, 1, None), ("a", 10, 2, "n1")], "a", True, 1),
        # a lapsed lease renewed with its old nonce is taken again, under a new nonce
        ([("a", 10, 0, None), ("a", 10, 20, "n1")], "a", True, 0),
    ],
)
def test_owner_record_table(steps, owner, held, contenders):
    record, out = run(steps)
    assert (record.owner, out.held, out.contenders) == (owner, held, contenders)
    assert (out.nonce is not None) == held


def test_a_holder_sees_its_nonce_and_no_one_else_sees_an_owner():
    record, taken = run([("a", 10, 0, None)])
    assert taken.nonce == "n1"
    _, lapsed_and_retaken = run([("a", 10, 0, None), ("a", 10, 20, "n1")])
    assert lapsed_and_retaken.nonce == "n2"
    read = answer(record, 4).to_json()
    assert read == {"version": 1, "held": False, "owned": True, "expires_in_sec": 6.0, "contenders": 0}
    assert answer(record, 11).owned is False


def test_contenders_are_capped_and_counted():
    steps = [("a", 10, 0, None)] + [(f"{i}".rjust(256, "x"), 3600, 1, None) for i in range(500)]
    record, refused = run(steps)
    assert len(record.contenders) == MAX_CONTENDERS and refused.contenders == MAX_CONTENDERS
    record, renewed = claim(record, "a", 10, 2, "n1")
    assert renewed and answer(record, 2, True).contenders == MAX_CONTENDERS
    assert len(str(answer(record, 2, True).to_json())) < 200


def test_owner_book_hands_the_nonce_to_the_claimer_only():
    book = OwnerBook(lambda: 0.0, nonces())
    first = book.claim({"gate_id": "a", "ttl_sec": 10})
    assert first["held"] and first["nonce"] == "n1"
    assert "nonce" not in book.claim({"gate_id": "b", "ttl_sec": 10}) and "nonce" not in book.read()
    assert book.claim({"gate_id": "a", "ttl_sec": 10, "nonce": "n1"})["held"]
    assert book.claim({"gate_id": "a", "ttl_sec": 0})["owned"] is True  # a release without the nonce: still held
    assert book.claim({"gate_id": "a", "ttl_sec": 0, "nonce": "n1"})["owned"] is False


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
        ({"gate_id": "a", "ttl_sec": 1, "nonce": 7}, "nonce"),
        ({"gate_id": "a", "ttl_sec": 1, "nonce": ""}, "nonce"),
        ({"gate_id": "a", "ttl_sec": 1, "nonce": "n" * 129}, "nonce"),
    ],
)
def test_bad_claims_name_the_field(body, param):
    with pytest.raises(OwnerClaimError) as err:
        OwnerClaim.parse(body)
    assert err.value.param == param


def test_parse_owner_answer():
    doc = {"held": True, "owned": True, "expires_in_sec": 3, "contenders": 2, "nonce": "n1"}
    assert OwnerAnswer.parse(doc) == OwnerAnswer(True, True, 3.0, 2, "n1")
    assert OwnerClaim.parse({"gate_id": "a", "ttl_sec": 1, "nonce": "n1"}) == OwnerClaim("a", 1.0, "n1")
    bad_answers = (
        [],
        {"held": "yes", "owned": True},
        {"held": True, "owned": True},  # held, but no nonce
        {"held": False, "owned": True, "contenders": ["b"]},  # a list: answers count contenders
        {"held": False, "owned": "x"},
    )
    for bad in bad_answers:
        with pytest.raises(ValueError):
            OwnerAnswer.parse(bad)


HELD = OwnerAnswer(True, True, 9.0, nonce="n1")
TAKEN = OwnerAnswer(False, True, 9.0)


@pytest.mark.parametrize(
    "previous, outcome, status",
    [
        (Ownership(), HELD, OWNER),
        (Ownership(), TAKEN, CONFLICT),
        (Ownership(), NO_API, UNCHECKED),
        (Ownership(), None, UNKNOWN),  # a failed claim changes nothing ...
        (Ownership(OWNER), None, OWNER),  # ... so a slow replica never flaps the gate
        (Ownership(CONFLICT), None, CONFLICT),
        (Ownership(CONFLICT), HELD, OWNER),  # the owner's lease lapsed: take over
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
    assert gate_mode(configured, Ownership(status)) == mode


@pytest.mark.parametrize(
    "ownership, flag",
    [
        (Ownership(OWNER), 0),
        (Ownership(OWNER, 1), 1),
        (Ownership(CONFLICT), 1),
        (Ownership(UNCHECKED), 0),
        (Ownership(), 0),
    ],
)
def test_conflict_flag(ownership, flag):
    assert conflict_flag(ownership) == flag


def test_transition_messages_say_what_changed_once():
    conflict = Ownership(CONFLICT, 0, 9.0)
    level, line = transition_message("r0", "me", Ownership(), conflict)
    assert level == logging.ERROR and "another kvgate" in line and "shadow" in line and "r0" in line
    assert transition_message("r0", "me", conflict, conflict) is None
    assert transition_message("r0", "me", Ownership(), Ownership(UNCHECKED))[0] == logging.WARNING
    assert transition_message("r0", "me", Ownership(), Ownership(OWNER))[0] == logging.INFO
    level, line = transition_message("r0", "me", Ownership(OWNER), Ownership(OWNER, 3))
    assert level == logging.ERROR and "3 other kvgate(s)" in line  # a count, never a list
    assert transition_message("r0", "me", Ownership(OWNER, 3), Ownership(OWNER, 5)) is None


@pytest.mark.parametrize(
    "healthy, ownership, ready, conflicts",
    [
        ({"r0": True}, {}, True, {}),
        ({"r0": False}, {}, False, {}),
        ({"r0": True}, {"r0": Ownership(CONFLICT, 0, 9.0)}, False, {"r0": "another kvgate, lease 9s left"}),
        ({"r0": True, "r1": True}, {"r0": Ownership(CONFLICT)}, True, {"r0": "another kvgate, lease 0s left"}),
        ({"r0": True}, {"r0": Ownership(UNCHECKED)}, True, {}),
    ],
)
def test_readiness(healthy, ownership, ready, conflicts):
    assert readiness(healthy, ownership) == (ready, conflicts)
