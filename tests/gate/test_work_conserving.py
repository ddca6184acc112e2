"""The economics of holding as pure functions on hand-worked states: quiet expiry of an
idle window, and the working_set policy's work-conserving rule (a held turn that goes in
because holding it costs more than the re-prefill it causes, and one that is held)."""

from __future__ import annotations

import math

import pytest

from kvgate.gate.book import TOKENS_PER_BYTE_WINDOW, SessionBook, SessionRecord
from kvgate.gate.policies.economics import (
    busy_rent_sec,
    evicted_window_blocks,
    holding_cost_sec,
    idle_in_flight_share,
    reprefill_sec,
    unprobed_work_conserving,
    work_conserving,
)
from kvgate.gate.policies.pricing import estimated_prompt_tokens
from kvgate.gate.policies.registry import WORKING_SET
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import AdmissionReason, Admit, Wait, WaitCause
from kvgate.gate.policies.working_set import working_set_decide
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.settings import GateSettings
from kvgate.gate.turn_facts import TurnFacts
from kvgate.gate.window_lifetime import quiet_lifetime
from tests.gate.helpers import asks_probe

SETTINGS = GateSettings()  # the defaults: quiet_factor 4, quiet_floor_sec 0.5, idle_grace_sec 60


# ---------------------------------------------------------------- quiet expiry


@pytest.mark.parametrize(
    "session_gap, replica_gap, expected",
    [
        (0.3, None, 1.2),  # 4 x its own gap
        (0.3, 5.0, 1.2),  # its own gap wins over the replica's
        (None, 2.0, 8.0),  # no gap yet: the replica's
        (None, None, 0.5),  # nothing measured: the floor
        (0.01, None, 0.5),  # a tiny gap: the floor
        (30.0, None, 60.0),  # a long gap: the ceiling (idle_grace_sec)
    ],
)
def test_quiet_lifetime(session_gap, replica_gap, expected):
    assert quiet_lifetime(session_gap, replica_gap, 4.0, 0.5, 60.0) == pytest.approx(expected)


class _Attempt:
    pass


def _turn(book: SessionBook, key: str, now: float, end: float, blocks: int = 10) -> None:
    """One admitted turn of `key` from `now` to `end`, holding a window of `blocks`."""
    attempt = _Attempt()
    rec, _ = book.begin_attempt(key, attempt, now)
    book.admit(rec, attempt, AdmissionReason.WINDOW_FITS.value, now, window=True, footprint=blocks)
    book.release(rec, end, attempt)


def test_a_window_ends_when_its_session_goes_quiet_and_its_record_at_the_grace():
    book = SessionBook(grace=60.0, quiet_factor=4.0, quiet_floor=0.5)
    _turn(book, "s", 0.0, 1.0)  # idle from 1.0; no gap yet: floor 0.5
    assert book.records["s"].quiet_deadline == pytest.approx(1.5)
    _turn(book, "s", 1.3, 2.0)  # gap 0.3 -> lifetime 1.2 -> window ends at 3.2
    rec = book.records["s"]
    assert (rec.last_gap, rec.quiet_deadline) == (pytest.approx(0.3), pytest.approx(3.2))
    assert book.purge(3.1) == ([], False) and rec.has_window  # not quiet yet
    ended, windows_ended = book.purge(3.2)
    assert ended == [] and windows_ended and not rec.has_window
    assert (book.windows_idle, book.idle_window_blocks, book.window_blocks) == (0, 0, 0)
    assert book.window_ends["quiet"] == 1 and book.take_window_ends() == ["quiet"]
    assert rec.last_window_end == "quiet" and "s" in book.records  # the record (gaps, sizes) lives on
    ended, windows_ended = book.purge(62.0)  # idle for the grace: the record ends, no window left
    assert [r.key for r in ended] == ["s"] and not windows_ended and not book.records


def test_a_session_back_before_its_quiet_deadline_keeps_its_window():
    book = SessionBook(grace=60.0, quiet_factor=4.0, quiet_floor=0.5)
    _turn(book, "s", 0.0, 1.0)
    _turn(book, "s", 1.3, 2.0)  # deadline 3.2
    _turn(book, "s", 3.0, 4.0)  # back at 3.0 (gap 1.0): the window held
    rec = book.records["s"]
    assert rec.has_window and book.window_ends["quiet"] == 0
    # gap EWMA (weight 0.5): 0.3 then 0.65; the last gap 1.0 is larger -> lifetime 4.0
    assert rec.quiet_deadline == pytest.approx(8.0)
    assert book.purge(7.9) == ([], False)  # the stale deadline of the earlier idle period is skipped


def test_a_session_without_a_gap_uses_the_replicas():
    book = SessionBook(grace=60.0, quiet_factor=4.0, quiet_floor=0.5)
    _turn(book, "a", 0.0, 1.0)
    _turn(book, "a", 3.0, 4.0)  # replica gap 2.0
    _turn(book, "b", 4.0, 5.0)  # b has no gap: 4 x 2.0
    assert book.records["b"].quiet_deadline == pytest.approx(13.0)


def test_the_book_learns_the_highest_recent_tokens_per_byte():
    """Every admitted turn with a prefix reading and a body bound records tokens per body
    byte (bound - 512); a named turn's facts carry the highest of the last 64, None before any."""
    book = SessionBook(grace=60.0)

    def facts(rec: SessionRecord | None) -> TurnFacts:
        return TurnFacts(book, rec, 0, 1512, lambda: 0, None, 0.0, 0.0)

    assert book.tokens_per_byte is None and facts(None).tokens_per_byte is None

    def probed_turn(key: str, tokens: int | None, bound: int | None) -> None:
        attempt = _Attempt()
        rec, _ = book.begin_attempt(key, attempt, 0.0)
        book.admit(rec, attempt, "work_conserving", 0.0, prompt_tokens=tokens, prompt_bound=bound)
        book.release(rec, 0.1, attempt)

    probed_turn("a", None, 1512)  # not probed: nothing learned
    probed_turn("a", 300, None)  # no bound (media): nothing learned
    probed_turn("a", 100, 300)  # a body under the margin: no bytes to divide by
    assert book.tokens_per_byte is None
    probed_turn("a", 250, 1512)  # 1,000 bytes
    probed_turn("b", 400, 1312)  # 800 bytes: the highest so far
    probed_turn("c", 100, 1512)
    assert book.tokens_per_byte == 0.5
    assert facts(book.records["c"]).tokens_per_byte == 0.5 and facts(None).tokens_per_byte is None
    for _ in range(TOKENS_PER_BYTE_WINDOW - 1):  # b's reading is pushed out of the window
        probed_turn("c", 100, 1512)
    assert book.tokens_per_byte == 0.1


# ------------------------------------------------------------ work-conserving

# A replica of 100 blocks of 16 tokens, 20 free; measured prefill 16,000 tokens/s
# (one block per millisecond) and 10 ms per decode step.
MEASURED = UsageReading(0.8, 100, 20, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01)
UNMEASURED = UsageReading(0.8, 100, 20, 16)
# The turn: a 40-block prompt, 10 blocks cached (30 new), 32 output tokens (2 blocks).
PROMPT = PrefixReading(total_blocks=40, hit_blocks=10, hit_ratio=0.25, total_tokens=640)
# 60 blocks in idle windows of other sessions: none of them fit beside this turn.
BUSY = WorkingSetView(idle_window_blocks=60, older_window_blocks=80, max_output_tokens=32, last_prompt_tokens=600)


def test_reprefill_and_holding_cost_by_hand():
    # needs 30 + 2 blocks. Books: 80 in windows, 20 spare -> 12 out of the windows. vLLM:
    # none free outside idle windows (20 - 60 < 0) -> all 32 out of idle windows. The larger: 32.
    assert evicted_window_blocks(BUSY, MEASURED, PROMPT, 20 - 60, 100) == 32
    # no window in the books; 10 free outside idle windows: 22 out of them, at most their 10
    assert (
        evicted_window_blocks(WorkingSetView(idle_window_blocks=10, max_output_tokens=32), MEASURED, PROMPT, 10, 100)
        == 10
    )
    # books only: 90 in windows (none idle), 10 spare: 22 of theirs
    assert (
        evicted_window_blocks(WorkingSetView(older_window_blocks=90, max_output_tokens=32), MEASURED, PROMPT, 20, 100)
        == 22
    )
    assert reprefill_sec(32, MEASURED) == pytest.approx(0.032)  # 512 tokens at 16,000/s
    assert reprefill_sec(32, UNMEASURED) is None
    # its 32-token decode at 10 ms a step (0.32 s), at half its worth (DECODE_SLACK_MARGIN)
    assert holding_cost_sec(BUSY, MEASURED) == pytest.approx(0.16)
    # ... of which a prefill-bound engine (75% of its time prefilling) has a quarter to spare
    prefill_bound = UsageReading(
        0.8, 100, 20, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01, prefill_share=0.75
    )
    assert holding_cost_sec(BUSY, prefill_bound) == pytest.approx(0.04)
    idle = WorkingSetView(max_output_tokens=1, replica_idle_sec=0.2, expected_gap_sec=0.5, waited_sec=0.1)
    assert holding_cost_sec(idle, MEASURED) == pytest.approx(0.5)  # idle: the gap before a holder returns


def test_a_work_conserving_admission():
    """Re-prefill of 32 evicted blocks + its own 40 (unprotected without a window): 72 ms,
    less than the 320 ms of decode that holding the turn back would leave unused (at half
    its worth: 160 ms)."""
    assert working_set_decide(BUSY, MEASURED, PROMPT, SETTINGS) == Admit(AdmissionReason.WORK_CONSERVING)


def test_a_held_admission():
    """A long prompt on a busy replica, short output: 60 evicted blocks + its own 110 (2,720
    tokens) cost 0.17 s of re-prefill, more than the 10 ms of decode it would share (5 ms
    at half its worth): held."""
    long_prompt = PrefixReading(total_blocks=110, hit_blocks=5, hit_ratio=0.05, total_tokens=1760)
    view = WorkingSetView(idle_window_blocks=60, older_window_blocks=20, max_output_tokens=1, last_prompt_tokens=1700)
    usage = UsageReading(0.8, 200, 60, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01)
    decision = working_set_decide(view, usage, long_prompt, SETTINGS)
    # needs 105 + 1 blocks, free outside idle windows 0 -> 60 come out of the idle windows (all of them)
    assert isinstance(decision, Wait) and decision.cause == WaitCause.NO_FREE_BLOCKS
    assert "re-prefill 0.170s > holding cost 0.005s" in decision.why
    assert decision.recheck_sec is None  # busy: only a release can change the balance
    # the same turn on an idle replica that has waited 40 ms of idle time: recheck in 130 ms
    idle = WorkingSetView(
        idle_window_blocks=60,
        older_window_blocks=20,
        max_output_tokens=1,
        last_prompt_tokens=1700,
        replica_idle_sec=0.04,
        waited_sec=0.05,
        expected_gap_sec=0.01,
    )
    held = working_set_decide(idle, usage, long_prompt, SETTINGS)
    assert isinstance(held, Wait) and held.recheck_sec == pytest.approx(0.13)
    # ... and once it has waited, idle, as long as the re-prefill (ski rental): admitted
    assert working_set_decide(
        WorkingSetView(**{**_fields(idle), "replica_idle_sec": 0.17, "waited_sec": 0.2}), usage, long_prompt, SETTINGS
    ) == Admit(AdmissionReason.WORK_CONSERVING)


def test_a_prefill_bound_engine_holds_what_a_decode_bound_one_admits():
    """A 160-block prompt (all new) + 8 output tokens (1 block) behind 500 blocks of windows
    on 512: 149 blocks of the windows go, and its own 160 are unprotected (4,944 tokens:
    0.309 s at 16,000 tokens/s), against 8 decode steps of 100 ms (0.8 s, 0.4 s at half its
    worth). A decode-bound engine (prefill share 0) has all of it to spare: admitted. A
    prefill-bound one (share 0.8) only 0.08 s: held."""
    prompt = PrefixReading(total_blocks=160, hit_blocks=0, hit_ratio=0.0, total_tokens=2560)
    view = WorkingSetView(older_window_blocks=500, idle_window_blocks=0, max_output_tokens=8, last_prompt_tokens=2400)

    def usage(share):
        return UsageReading(0.9, 512, 100, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.1, prefill_share=share)

    assert working_set_decide(view, usage(0.0), prompt, SETTINGS) == Admit(AdmissionReason.WORK_CONSERVING)
    held = working_set_decide(view, usage(0.8), prompt, SETTINGS)
    assert isinstance(held, Wait) and "re-prefill 0.309s > holding cost 0.080s" in held.why


def test_no_measurement_yet_holds_and_the_knob_turns_it_off():
    assert isinstance(working_set_decide(BUSY, UNMEASURED, PROMPT, SETTINGS), Wait)
    off = GateSettings(work_conserving=False)
    assert isinstance(working_set_decide(BUSY, MEASURED, PROMPT, off), Wait)
    assert work_conserving(BUSY, MEASURED, 32, off) == Wait(
        WaitCause.WORTH_HOLDING, "gate.work_conserving is off: holding"
    )
    assert work_conserving(BUSY, UNMEASURED, 32, SETTINGS) == Wait(
        WaitCause.WORTH_HOLDING, "no prefill-throughput measurement: holding"
    )


def test_a_cold_engine_admits_what_pushes_no_idle_window_out():
    """An engine that has not measured its prefill throughput (it has computed no prompt
    since it started: the sessions of a rollout arriving at once) cannot price a hold. A
    turn the windows' books do not fit goes in without a window while vLLM has the free
    blocks for it outside idle windows, as it would without the gate, instead of waiting
    for the first measurement; one that would push idle windows' blocks out is held."""
    in_flight = WorkingSetView(older_window_blocks=80, max_output_tokens=32)  # every window in flight
    cold = UsageReading(0.2, 100, 80, 16)
    decision = working_set_decide(in_flight, cold, PROMPT, SETTINGS)
    assert decision == Admit(AdmissionReason.WORK_CONSERVING)
    # the same turn beside 60 blocks of idle windows, with 20 free: 32 blocks come out of theirs
    assert isinstance(working_set_decide(BUSY, UNMEASURED, PROMPT, SETTINGS), Wait)
    # measured, the rule prices it: holding costs nothing here (no decode-step measurement)
    measured = UsageReading(0.2, 100, 80, 16, prefill_tokens_per_sec=16000.0)
    assert isinstance(working_set_decide(in_flight, measured, PROMPT, SETTINGS), Wait)
    # and with the rule off the books alone decide
    assert isinstance(working_set_decide(in_flight, cold, PROMPT, GateSettings(work_conserving=False)), Wait)


def test_a_holder_that_no_longer_fits_goes_in_work_conserving_without_its_window():
    holder = WorkingSetView(
        has_window=True,
        idle_window_blocks=60,
        older_window_blocks=80,
        max_output_tokens=32,
        last_prompt_tokens=600,
    )
    assert working_set_decide(holder, MEASURED, PROMPT, SETTINGS) == Admit(AdmissionReason.WORK_CONSERVING)
    held = working_set_decide(holder, UNMEASURED, PROMPT, SETTINGS)
    assert isinstance(held, Wait) and held.drop_window and held.cause == WaitCause.WINDOW_LOST


def test_a_newcomer_behind_others_is_decided_at_once_but_only_work_conserving():
    """Waiters are not decided one probe at a time: a newcomer behind 3 others is probed
    and goes in `work_conserving` when the rule says so (BUSY's numbers: 72 ms of
    re-prefill against 160 ms of decode slack), but never takes a window before them,
    even where one would fit."""
    behind = WorkingSetView(**{**_fields(BUSY), "waiters_ahead": 3, "prompt_bound_tokens": None})
    assert asks_probe(WORKING_SET, behind, MEASURED, SETTINGS)
    assert working_set_decide(behind, MEASURED, PROMPT, SETTINGS) == Admit(AdmissionReason.WORK_CONSERVING)
    # a roomy replica: a head newcomer gets a window ((640 + 32) / 16 = 42 blocks), one behind
    # others only goes in work-conserving
    roomy = UsageReading(0.1, 100, 100, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01)
    assert working_set_decide(WorkingSetView(max_output_tokens=32), roomy, PROMPT, SETTINGS) == Admit(
        AdmissionReason.WINDOW_FITS, window=True, footprint=42
    )
    assert working_set_decide(WorkingSetView(max_output_tokens=32, waiters_ahead=1), roomy, PROMPT, SETTINGS) == Admit(
        AdmissionReason.WORK_CONSERVING
    )
    # held: a 1-token turn whose own 40 blocks (640 tokens, 40 ms) outweigh 5 ms of slack:
    # no freed block can let it in, so it waits for its place, unpolled
    held = working_set_decide(WorkingSetView(max_output_tokens=1, waiters_ahead=1), roomy, PROMPT, SETTINGS)
    assert held == Wait(
        WaitCause.BEHIND_WAITERS,
        "behind 1 waiting sessions (first come, first served); re-prefill 0.040s > holding cost 0.005s",
        poll=False,
    )
    # held by the windows' blocks it would push out: 90 in older windows leave 10 spare, so
    # 21 of its 31 new blocks come out of them; 61 blocks (61 ms) against 10 decode steps
    # at half their worth (50 ms), but its own 40 (40 ms) alone would pass: more room may
    # tip the balance, so it decides again on every release (and polls)
    crowded = WorkingSetView(max_output_tokens=10, waiters_ahead=1, older_window_blocks=90)
    assert working_set_decide(crowded, roomy, PROMPT, SETTINGS) == Wait(
        WaitCause.BEHIND_WAITERS,
        "behind 1 waiting sessions (first come, first served); re-prefill 0.061s > holding cost 0.050s",
        wake_on_release=True,
    )
    # without a measurement or with the rule off: not probed, it waits its turn
    for usage, settings in ((UNMEASURED, SETTINGS), (MEASURED, GateSettings(work_conserving=False))):
        assert not asks_probe(WORKING_SET, behind, usage, settings)
        assert working_set_decide(behind, usage, None, settings) == Wait(
            WaitCause.BEHIND_WAITERS, "behind 3 waiting sessions (first come, first served)", poll=False
        )


def test_a_cheap_newcomer_goes_in_without_a_probe():
    """A newcomer behind another waiter, or at the head of the queue, with history:
    600 tokens last turn, its body grew by 100 bytes since, so its prompt is at most
    600 + 100 + 64 = 764 tokens (48 blocks), none cached at worst, + 32 output tokens
    (2 blocks): 50 blocks to allocate. 96 usable (headroom 4), 80 in windows: 16 spare,
    so 34 come out of the windows; with its own 48 unprotected, 82 blocks (82 ms at one
    block per ms) at risk, against 32 decode steps of 10 ms at half their worth (160 ms):
    admitted even at its worst case, so it is not probed."""
    view = WorkingSetView(
        older_window_blocks=80,
        other_window_blocks=80,
        max_output_tokens=32,
        last_prompt_tokens=600,
        last_prompt_bound=1000,
        prompt_bound_tokens=1100,
        waiters_ahead=1,
    )
    for head_or_behind in (view, WorkingSetView(**{**_fields(view), "waiters_ahead": 0})):
        assert unprobed_work_conserving(head_or_behind, MEASURED, SETTINGS)
        assert not asks_probe(WORKING_SET, head_or_behind, MEASURED, SETTINGS)
        for prefix in (None, PROMPT):
            assert working_set_decide(head_or_behind, MEASURED, prefix, SETTINGS) == Admit(
                AdmissionReason.WORK_CONSERVING
            )
    # probed: 4 output tokens (20 ms of slack), no bound (media), or a holder (its window is
    # re-priced); behind without the rule or its measurement: waits, unprobed
    for changed, usage, settings, probed in (
        ({"max_output_tokens": 4}, MEASURED, SETTINGS, True),
        ({"prompt_bound_tokens": None}, MEASURED, SETTINGS, True),
        ({"has_window": True}, MEASURED, SETTINGS, True),
        ({}, MEASURED, GateSettings(work_conserving=False), False),
        ({}, UNMEASURED, SETTINGS, False),
    ):
        other = WorkingSetView(**{**_fields(view), **changed})
        assert not unprobed_work_conserving(other, usage, settings)
        assert asks_probe(WORKING_SET, other, usage, settings) is probed, changed


@pytest.mark.parametrize(
    ("changed", "tokens"),
    [
        ({}, 1512),  # no ratio observed yet: the bound (1,000 body bytes + a 512-token template margin)
        ({"tokens_per_byte": 0.25}, 250),  # the body's 1,000 bytes at 0.25 tokens a byte
        ({"tokens_per_byte": 2.0}, 1512),  # never above the bound
        # history: 600 tokens at a 1,312-token bound (800 bytes): 200 bytes grown, 50 tokens
        ({"tokens_per_byte": 0.25, "last_prompt_tokens": 600, "last_prompt_bound": 1312}, 650),
        # the history bound (600 + 200 + 64) caps a ratio that would go above it
        ({"tokens_per_byte": 1.5, "last_prompt_tokens": 600, "last_prompt_bound": 1312}, 864),
        ({"tokens_per_byte": 0.25, "prompt_bound_tokens": None}, None),  # media: no bound, no estimate
    ],
)
def test_estimated_prompt_tokens(changed, tokens):
    view = WorkingSetView(**{**_fields(WorkingSetView(prompt_bound_tokens=1512)), **changed})
    assert estimated_prompt_tokens(view) == tokens


def test_a_newcomer_goes_in_unprobed_at_its_estimated_price():
    """A newcomer at the head of the queue with no history: a 1,000-byte body, so its
    prompt is at most 1,512 tokens (95 blocks of 16). At that worst case, + 2 output
    blocks, 97 blocks to allocate: 16 spare beside the 80 in windows (96 usable), so
    80 come out of them, and with its own 95, 175 blocks (175 ms at one block per ms)
    are at risk against 160 ms of holding cost: held, so without a ratio it is probed.
    The replica's prompts have run at most 0.25 tokens a byte: 250 tokens (16 blocks),
    18 to allocate, 2 out of the windows, 18 ms at risk: admitted `work_conserving`
    without a probe, whatever the probe would have said."""
    view = WorkingSetView(
        older_window_blocks=80, other_window_blocks=80, max_output_tokens=32, prompt_bound_tokens=1512
    )
    assert not unprobed_work_conserving(view, MEASURED, SETTINGS)
    assert asks_probe(WORKING_SET, view, MEASURED, SETTINGS)
    estimated = WorkingSetView(**{**_fields(view), "tokens_per_byte": 0.25})
    assert unprobed_work_conserving(estimated, MEASURED, SETTINGS)
    assert not asks_probe(WORKING_SET, estimated, MEASURED, SETTINGS)
    for prefix in (None, PROMPT, PrefixReading(total_blocks=95, hit_blocks=0, hit_ratio=0.0, total_tokens=1512)):
        assert working_set_decide(estimated, MEASURED, prefix, SETTINGS) == Admit(AdmissionReason.WORK_CONSERVING)
    # a holder is still probed: the exact price may keep its window
    holder = WorkingSetView(**{**_fields(estimated), "has_window": True})
    assert not unprobed_work_conserving(holder, MEASURED, SETTINGS)
    assert asks_probe(WORKING_SET, holder, MEASURED, SETTINGS)


def _fields(view: WorkingSetView) -> dict:
    return {name: getattr(view, name) for name in WorkingSetView.__slots__}


# ------------------------------------------------ waiting on an engine that is not computing

# The held turn of `test_a_held_admission`: 0.17 s of re-prefill against 5 ms of decode slack.
LONG_PROMPT = PrefixReading(total_blocks=110, hit_blocks=5, hit_ratio=0.05, total_tokens=1760)
HELD = WorkingSetView(idle_window_blocks=60, older_window_blocks=20, max_output_tokens=1, last_prompt_tokens=1700)


def _engine(busy_share: float | None, waiting: int | None = None) -> UsageReading:
    return UsageReading(
        0.8,
        200,
        60,
        16,
        prefill_tokens_per_sec=16000.0,
        decode_step_sec=0.01,
        busy_share=busy_share,
        num_running=2,
        num_waiting=waiting,
    )


def test_a_busy_replicas_wait_costs_the_engines_idle_share():
    """A turn held 0.2 s on a replica with turns in flight whose engine stepped 40% of the
    time: its wait left 0.12 s of engine time unused, more than its 5 ms of decode slack.
    Behind two named waiters it shares that idle time with them: a third."""
    waited = WorkingSetView(**{**_fields(HELD), "waited_sec": 0.2})
    assert busy_rent_sec(waited, _engine(0.4)) == pytest.approx(0.12)
    assert holding_cost_sec(waited, _engine(0.4)) == pytest.approx(0.12)
    behind = WorkingSetView(**{**_fields(waited), "waiters_ahead": 2})
    assert busy_rent_sec(behind, _engine(0.4)) == pytest.approx(0.04)
    # an engine stepping back to back computes for others meanwhile: no rent; unmeasured: none
    assert busy_rent_sec(waited, _engine(1.0)) == 0.0
    assert busy_rent_sec(waited, _engine(None)) == 0.0
    # an idle replica's wait is the ski-rental term's, not the rent's
    idle = WorkingSetView(**{**_fields(waited), "replica_idle_sec": 0.1})
    assert busy_rent_sec(idle, _engine(0.4)) == 0.0


def test_an_engine_with_requests_waiting_charges_no_rent():
    """The engine of `test_a_busy_replicas_wait_costs_the_engines_idle_share`, but with two
    requests in its own queue: it has more work than it schedules, so its idle share is
    its requests' own time between steps, which the held turn, admitted, could not fill:
    it would queue behind them. The wait costs nothing: the turn waits on, where without
    the queue it went in after 0.5 s."""
    waited = WorkingSetView(**{**_fields(HELD), "waited_sec": 0.5})
    assert busy_rent_sec(waited, _engine(0.4, waiting=2)) == 0.0
    assert working_set_decide(waited, _engine(0.4, waiting=0), LONG_PROMPT, SETTINGS) == Admit(
        AdmissionReason.WORK_CONSERVING
    )
    queued = working_set_decide(waited, _engine(0.4, waiting=2), LONG_PROMPT, SETTINGS)
    assert isinstance(queued, Wait) and queued.cause == WaitCause.NO_FREE_BLOCKS


def test_a_held_turn_goes_in_once_its_wait_cost_the_re_prefill_it_saves():
    """0.17 s of re-prefill. Just arrived on an engine busy 60% of the time: held, and due
    again when 0.4 s of rent per second has paid for the rest: (0.17 - 0.005) / 0.4 s.
    After 0.5 s it has cost 0.2 s: admitted without a window. On an engine busy all the
    time, or one that does not measure it, it waits for a release as before."""
    held = working_set_decide(HELD, _engine(0.6), LONG_PROMPT, SETTINGS)
    assert isinstance(held, Wait) and held.cause == WaitCause.NO_FREE_BLOCKS
    assert held.recheck_sec == pytest.approx((0.17 - 0.005) / 0.4)
    waited = WorkingSetView(**{**_fields(HELD), "waited_sec": 0.5})
    assert working_set_decide(waited, _engine(0.6), LONG_PROMPT, SETTINGS) == Admit(AdmissionReason.WORK_CONSERVING)
    for saturated in (_engine(1.0), _engine(None)):
        still = working_set_decide(waited, saturated, LONG_PROMPT, SETTINGS)
        assert isinstance(still, Wait) and still.recheck_sec is None


def test_a_probe_that_costs_more_than_it_can_save_is_not_asked():
    """The newcomer of `test_a_newcomer_goes_in_unprobed_at_its_estimated_price`, without a
    ratio: at its worst case 175 ms at risk against 160 ms of holding cost, so it is
    probed. But on this replica a turn has lately waited 0.4 s for a prefix probe, and its
    engine steps half the time: once probed, its wait alone would have cost 200 ms, more
    than the re-prefill at the estimate's worst case: admitted now, unprobed."""
    view = WorkingSetView(older_window_blocks=80, max_output_tokens=32, prompt_bound_tokens=1512)
    half_busy = UsageReading(0.8, 100, 20, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01, busy_share=0.5)
    assert asks_probe(WORKING_SET, view, half_busy, SETTINGS)  # no probe latency known yet
    slow_probe = WorkingSetView(**{**_fields(view), "prefix_probe_sec": 0.4})
    assert unprobed_work_conserving(slow_probe, half_busy, SETTINGS)
    assert not asks_probe(WORKING_SET, slow_probe, half_busy, SETTINGS)
    # a faster probe (0.1 s: 50 ms of rent, below the decode slack), or an engine computing
    # all the time: probed
    fast_probe = WorkingSetView(**{**_fields(view), "prefix_probe_sec": 0.1})
    assert asks_probe(WORKING_SET, fast_probe, half_busy, SETTINGS)
    assert asks_probe(WORKING_SET, slow_probe, MEASURED, SETTINGS)


def test_the_book_smooths_the_prefix_probe_latency():
    book = SessionBook(grace=60.0)
    assert book.prefix_probe_ewma is None
    book.observe_prefix_probe(0.1)
    book.observe_prefix_probe(0.2)
    assert book.prefix_probe_ewma == pytest.approx(0.13)  # 0.1 + 0.3 x 0.1
    rec, _ = book.begin_attempt("s", _Attempt(), 0.0)
    assert TurnFacts(book, rec, 1, None, lambda: 0, None, 0.0, 0.0).prefix_probe_sec == pytest.approx(0.13)
    assert TurnFacts(book, None, 1, None, lambda: 0, None, 0.0, 0.0).prefix_probe_sec is None


def test_the_rent_counts_only_the_engines_idle_time_with_turns_in_flight():
    """The engine of `test_a_busy_replicas_wait_costs_the_engines_idle_share` idled 60% of
    its recent time, but for half of it the replica had no turn in flight at all (its
    sessions were in tool calls: the idle-replica terms charge that, when it happens).
    Idle with turns in flight 10% of the time: the 0.2 s wait cost 20 ms, and the turn of
    `test_a_held_turn_goes_in_once_its_wait_cost_the_re_prefill_it_saves`, rechecked at
    that rate, waits 4x longer before the rent pays its re-prefill. Where the replica's
    empty time covers all of the engine's idle time, the wait costs nothing."""
    waited = WorkingSetView(**{**_fields(HELD), "waited_sec": 0.2, "replica_empty_share": 0.3})
    assert idle_in_flight_share(waited, _engine(0.6)) == pytest.approx(0.1)
    assert busy_rent_sec(waited, _engine(0.6)) == pytest.approx(0.02)
    held = working_set_decide(
        WorkingSetView(**{**_fields(HELD), "replica_empty_share": 0.3}), _engine(0.6), LONG_PROMPT, SETTINGS
    )
    assert isinstance(held, Wait) and held.recheck_sec == pytest.approx((0.17 - 0.005) / 0.1)
    emptier = WorkingSetView(**{**_fields(waited), "replica_empty_share": 0.5, "waited_sec": 5.0})
    assert idle_in_flight_share(emptier, _engine(0.6)) == 0.0
    assert busy_rent_sec(emptier, _engine(0.6)) == 0.0
    still = working_set_decide(emptier, _engine(0.6), LONG_PROMPT, SETTINGS)
    assert isinstance(still, Wait) and still.recheck_sec is None
    assert idle_in_flight_share(waited, _engine(None)) is None


def test_the_book_meters_the_replicas_spells_with_no_turn_in_flight():
    """Leases out 1-2 s and from 4 s on (two overlapping ones 4-5 s): the meter starts at
    the first lease, and at 5 s the one empty spell (2-4 s) took its decayed share of the
    wall time since 1 s, read as the engine's busy share is (`BusyMeter`, 2 s horizon).
    The spell before the first lease does not count, and the turn facts read the share."""
    book = SessionBook(grace=30.0)
    assert book.empty_share(0.5) == 0.0
    book.admit(None, object(), "anonymous", 1.0)
    assert book.empty_share(1.5) == 0.0
    book.release(None, 2.0)
    book.admit(None, object(), "anonymous", 4.0)
    book.admit(None, object(), "anonymous", 4.5)
    book.release(None, 5.0)  # one still out: no new spell
    spell = math.exp(-0.5) - math.exp(-1.5)  # exp(-(5 - u) / 2) / 2 over 2 <= u <= 4
    wall = 1.0 - math.exp(-2.0)  # the same over 1 <= u <= 5
    assert book.empty_share(5.0) == pytest.approx(spell / wall)
    rec = SessionRecord("s")
    facts = TurnFacts(book, rec, 0, None, lambda: 0, None, 5.0, 5.0)
    assert facts.replica_empty_share == pytest.approx(spell / wall)
