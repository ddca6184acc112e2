"""The pin contract's own rules (`wire.kv_pins`): proofs, parsing, and the body rewrite."""

from __future__ import annotations

import pytest

from kvgate.wire.kv_pins import (
    PIN_KEY,
    Pin,
    PinError,
    ReleaseAnswer,
    ReleaseQuery,
    make_pin,
    pin_of,
    pin_proof,
    with_pin,
    without_pin,
)
from kvgate.wire.probe_api import KvAnswer, merge_kv


def test_a_pin_is_valid_only_with_the_replica_keys_proof():
    pin = make_pin("s1", 30, "key")
    assert pin.valid_for("key")
    assert not pin.valid_for("other key")
    assert not Pin("s2", 30, pin.proof).valid_for("key"), "a proof is bound to its session"
    assert Pin("s1", 30, "").valid_for(None), "an open replica keeps any pin"
    assert pin_proof(None, "s1") == ""


def test_with_pin_keeps_other_transfer_params_and_the_body():
    body = {"model": "m", "kv_transfer_params": {"do_remote_prefill": True}}
    pinned = with_pin(body, make_pin("s", 5, None))
    assert pinned["kv_transfer_params"] == {
        "do_remote_prefill": True,
        PIN_KEY: {"session": "s", "ttl_sec": 5.0, "proof": ""},
    }
    assert body == {"model": "m", "kv_transfer_params": {"do_remote_prefill": True}}, "the body is not modified"
    assert pin_of(pinned["kv_transfer_params"]) == Pin("s", 5.0, "")


def test_without_pin_strips_only_the_pin():
    body = {"model": "m"}
    assert without_pin(body) is body
    assert without_pin(with_pin(body, make_pin("s", 5, "k"))) == {"model": "m"}
    mixed = with_pin({"kv_transfer_params": {"x": 1}}, make_pin("s", 5, "k"))
    assert without_pin(mixed) == {"kv_transfer_params": {"x": 1}}


@pytest.mark.parametrize(
    "doc, field",
    [
        ("s", "object"),
        ({"ttl_sec": 1}, "session"),
        ({"session": "", "ttl_sec": 1}, "session"),
        ({"session": "x" * 257, "ttl_sec": 1}, "session"),
        ({"session": "s", "ttl_sec": 0}, "ttl_sec"),
        ({"session": "s", "ttl_sec": True}, "ttl_sec"),
        ({"session": "s", "ttl_sec": float("inf")}, "ttl_sec"),
        ({"session": "s", "ttl_sec": 1, "proof": 3}, "proof"),
    ],
)
def test_a_malformed_pin_names_its_field(doc, field):
    with pytest.raises(PinError, match=field):
        pin_of({PIN_KEY: doc})


def test_no_pin_is_none():
    assert pin_of(None) is None and pin_of({"other": 1}) is None


def test_release_messages_round_trip_and_refuse_bad_bodies():
    assert ReleaseQuery.parse(ReleaseQuery(("a", "b")).to_json()) == ReleaseQuery(("a", "b"))
    assert ReleaseAnswer.parse(ReleaseAnswer(2, 7).to_json()) == ReleaseAnswer(2, 7)
    for bad in ({}, {"sessions": "a"}, {"sessions": [1]}, {"sessions": [""]}):
        with pytest.raises(PinError):
            ReleaseQuery.parse(bad)
    with pytest.raises(PinError):
        ReleaseAnswer.parse({"released_sessions": -1, "released_blocks": 0})


def test_the_kv_answer_carries_pins_and_sums_them_over_engines():
    one = KvAnswer.of_engine(
        num_gpu_blocks=11,
        num_free_blocks=4,
        num_cached_blocks=6,
        block_size=16,
        num_running=0,
        num_waiting=0,
        num_pinned_blocks=3,
        num_pinned_sessions=1,
        num_pin_yields=2,
    )
    assert KvAnswer.parse(one.to_json()) == one
    merged = merge_kv([one, one])
    assert (merged.num_pinned_blocks, merged.num_pinned_sessions, merged.num_pin_yields) == (6, 2, 4)
    assert KvAnswer.parse({"kv_cache_usage": 0.5}).num_pinned_blocks is None, "a server without pins says nothing"


def test_the_cpu_tier_fields_round_trip_and_stay_within_the_prompt():
    from kvgate.wire.probe_api import PrefixAnswer, ProbeAnswerError

    answer = PrefixAnswer.of_engine(
        total_tokens=64, block_size=16, hit_block_ref_counts=[0], hit_tokens=16, hit_blocks_cpu=9
    )
    assert (answer.hit_blocks, answer.hit_blocks_cpu) == (1, 3), (
        "the CPU run is clipped to the blocks after the GPU hit"
    )
    assert PrefixAnswer.parse(answer.to_json()) == answer
    with pytest.raises(ProbeAnswerError, match="hit_blocks_cpu"):
        PrefixAnswer.parse({**answer.to_json(), "hit_blocks_cpu": 4})
    kv = KvAnswer.parse(
        {"kv_cache_usage": 0.1, "num_cpu_blocks": 8, "num_cpu_cached_blocks": 2, "cpu_load_sec_per_block": 1e-4}
    )
    assert merge_kv([kv, kv]).num_cpu_blocks == 16 and merge_kv([kv, kv]).cpu_load_sec_per_block == 1e-4
