"""The decision policies as pure functions: every branch, no event loop."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from kvgate.gate.policies.pricing import (
    HISTORY_MARGIN_TOKENS,
    bounded_footprint,
    footprint_blocks,
    history_bound,
)
from kvgate.gate.policies.registry import POLICIES, WATERMARK, WORKING_SET, get_policy
from kvgate.gate.policies.views import WorkingSetView
from kvgate.gate.policies.vocabulary import (
    PREFIX_UNAVAILABLE,
    AdmissionReason,
    Admit,
    ProbeFirst,
    Reject,
    RejectCode,
    Wait,
    WaitCause,
)
from kvgate.gate.policies.working_set import working_set_decide
from kvgate.gate.readings import PrefixReading, UsageReading
from kvgate.gate.request_body import (
    _MEDIA_MARKERS,
    TEMPLATE_MARGIN_TOKENS,
    output_allowance,
    prompt_token_bound,
)
from kvgate.gate.settings import GateSettings
from tests.gate.helpers import asks_probe

SETTINGS = GateSettings(high_watermark=0.85, hit_threshold=0.80, headroom_blocks=4)
LOW = UsageReading(0.5, 100, 50)
HIGH = UsageReading(0.9, 100, 10)
AT = UsageReading(0.85, 100, 15)
HIGH_NO_BLOCKS = UsageReading(0.9, source="metrics")
LOW_NO_BLOCKS = UsageReading(0.5, source="metrics")
COLD = PrefixReading(total_blocks=20, hit_blocks=2, hit_ratio=0.1)
HOT = PrefixReading(total_blocks=20, hit_blocks=18, hit_ratio=0.9)
EDGE = PrefixReading(total_blocks=10, hit_blocks=8, hit_ratio=0.8)

NAMED = WorkingSetView()
HOLDER = WorkingSetView(has_window=True)
ANON = WorkingSetView(anonymous=True)


# ------------------------------------------------------------- watermark


@pytest.mark.parametrize(
    "view, usage, prefix, expected",
    [
        (NAMED, None, None, Admit(AdmissionReason.OPEN, wake_next=True)),  # usage unknown
        (HOLDER, None, None, Admit(AdmissionReason.OPEN, window=True, wake_next=True)),  # ... keeps its window
        (ANON, None, None, Admit(AdmissionReason.OPEN, wake_next=True)),
        (ANON, LOW, None, Admit(AdmissionReason.ANONYMOUS, wake_next=True)),  # anonymous below
        (
            ANON,
            HIGH,
            HOT,
            Wait(WaitCause.ANONYMOUS_ABOVE_WATERMARK, "anonymous request above the watermark"),
        ),  # anonymous above: watermark only
        (NAMED, LOW, None, Admit(AdmissionReason.OPEN, wake_next=True)),  # below the watermark
        (HOLDER, LOW, None, Admit(AdmissionReason.OPEN, window=True, wake_next=True)),  # window kept and renewed
        (HOLDER, HIGH, None, Admit(AdmissionReason.HOLDS_WINDOW, window=True)),
        (NAMED, HIGH, PREFIX_UNAVAILABLE, Admit(AdmissionReason.PREFIX_PROBE_UNAVAILABLE)),
        (NAMED, HIGH, HOT, Admit(AdmissionReason.RESIDENT_PREFIX, window=True, footprint=20)),
        (NAMED, AT, EDGE, Admit(AdmissionReason.RESIDENT_PREFIX, window=True, footprint=10)),  # >= at both edges
        (NAMED, HIGH, COLD, Wait(WaitCause.COLD_PREFIX, "cold prefix above the watermark")),
    ],
)
def test_watermark_decide(view, usage, prefix, expected):
    assert WATERMARK.decide(WATERMARK.view(view), usage, prefix, SETTINGS) == expected


def test_watermark_without_retain_session_never_opens_a_window():
    settings = GateSettings(retain_session=False)
    assert WATERMARK.decide(WATERMARK.view(NAMED), HIGH, HOT, settings) == Admit(
        AdmissionReason.RESIDENT_PREFIX, window=False, footprint=20
    )
    assert WATERMARK.decide(WATERMARK.view(HOLDER), HIGH, None, settings) == Admit(
        AdmissionReason.HOLDS_WINDOW, window=False
    )
    assert WATERMARK.decide(WATERMARK.view(HOLDER), LOW, None, settings) == Admit(
        AdmissionReason.OPEN, window=False, wake_next=True
    )


@pytest.mark.parametrize(
    "view, usage, expected",
    [
        (NAMED, None, False),
        (NAMED, LOW, False),
        (NAMED, AT, True),
        (NAMED, HIGH, True),
        (HOLDER, HIGH, False),
        (ANON, HIGH, False),
    ],
)
def test_watermark_asks_prefix_only_above_watermark_for_sessions_without_window(view, usage, expected):
    assert asks_probe(WATERMARK, view, usage, SETTINGS) is expected


# ----------------------------------------------------------- working_set


@pytest.mark.parametrize(
    "view, usage, prefix, expected",
    [
        (NAMED, None, None, Admit(AdmissionReason.OPEN, wake_next=True)),
        (HOLDER, None, None, Admit(AdmissionReason.OPEN, window=True, wake_next=True)),
        (ANON, LOW, None, Admit(AdmissionReason.ANONYMOUS, wake_next=True)),
        (ANON, HIGH, None, Wait(WaitCause.ANONYMOUS_ABOVE_WATERMARK, "anonymous request above the watermark")),
        # a holder whose prefix probe failed keeps its window as last priced, at any usage
        (HOLDER, LOW, PREFIX_UNAVAILABLE, Admit(AdmissionReason.HOLDS_WINDOW, window=True)),
        (HOLDER, HIGH, PREFIX_UNAVAILABLE, Admit(AdmissionReason.HOLDS_WINDOW, window=True)),
        (HOLDER, HIGH_NO_BLOCKS, PREFIX_UNAVAILABLE, Admit(AdmissionReason.HOLDS_WINDOW, window=True)),
        # no block counts (/metrics fallback): the watermark policy decides
        (NAMED, LOW_NO_BLOCKS, None, Admit(AdmissionReason.OPEN, wake_next=True)),
        (NAMED, HIGH_NO_BLOCKS, PREFIX_UNAVAILABLE, Admit(AdmissionReason.PREFIX_PROBE_UNAVAILABLE)),
        # prefix probe failed: the watermark policy decides
        (NAMED, LOW, PREFIX_UNAVAILABLE, Admit(AdmissionReason.OPEN, wake_next=True)),
        (NAMED, HIGH, PREFIX_UNAVAILABLE, Admit(AdmissionReason.PREFIX_PROBE_UNAVAILABLE)),
    ],
)
def test_working_set_decide_fallbacks(view, usage, prefix, expected):
    assert WORKING_SET.decide(view, usage, prefix, SETTINGS) == expected


def test_working_set_hand_worked_budget():
    # 100 usable blocks, 40 free, 10 held by idle windows, headroom 4: budget 26.
    usage = UsageReading(0.6, 100, 40)
    view = WorkingSetView(idle_window_blocks=10)
    fits = PrefixReading(total_blocks=30, hit_blocks=4, hit_ratio=4 / 30)  # 26 new: fits exactly
    over = PrefixReading(total_blocks=30, hit_blocks=3, hit_ratio=0.1)  # 27 new: waits
    assert WORKING_SET.decide(view, usage, fits, SETTINGS) == Admit(
        AdmissionReason.WINDOW_FITS, window=True, footprint=30
    )
    decision = WORKING_SET.decide(view, usage, over, SETTINGS)
    assert isinstance(decision, Wait) and decision.cause == WaitCause.NO_FREE_BLOCKS
    assert "27" in decision.why and "26" in decision.why


def test_working_set_waits_below_watermark_when_idle_windows_hold_the_free_blocks():
    # usage reads 20% yet the free blocks are idle sessions' prefixes: the watermark is fooled, working_set is not.
    usage = UsageReading(0.2, 100, 80)
    view = WorkingSetView(idle_window_blocks=70)
    prompt = PrefixReading(total_blocks=12, hit_blocks=0, hit_ratio=0.0)
    assert WORKING_SET.decide(view, usage, prompt, SETTINGS).cause == WaitCause.NO_FREE_BLOCKS
    assert WATERMARK.decide(WATERMARK.view(view), usage, prompt, SETTINGS) == Admit(
        AdmissionReason.OPEN, wake_next=True
    )


def test_working_set_hot_prefix_needs_only_its_new_blocks():
    usage = UsageReading(0.95, 100, 6)
    assert WORKING_SET.decide(NAMED, usage, HOT, SETTINGS) == Admit(
        AdmissionReason.WINDOW_FITS, window=True, footprint=20
    )


@pytest.mark.parametrize("total, rejected", [(96, False), (97, True), (500, True)])
def test_working_set_prompt_too_long_against_usable_blocks(total, rejected):
    # usable = 100 total - 4 headroom = 96
    prompt = PrefixReading(total_blocks=total, hit_blocks=0, hit_ratio=0.0)
    decision = WORKING_SET.decide(NAMED, UsageReading(0.0, 100, 100), prompt, SETTINGS)
    if rejected:
        assert isinstance(decision, Reject) and decision.code == RejectCode.PROMPT_TOO_LONG
        assert str(total) in decision.message and "headroom_blocks" in decision.message
    else:
        assert decision == Admit(AdmissionReason.WINDOW_FITS, window=True, footprint=total)


def test_working_set_without_retain_session_opens_no_window():
    settings = GateSettings(retain_session=False)
    assert WORKING_SET.decide(NAMED, LOW, COLD, settings) == Admit(
        AdmissionReason.WINDOW_FITS, window=False, footprint=20
    )


@pytest.mark.parametrize(
    "view, usage, expected",
    [
        (NAMED, None, False),
        (NAMED, LOW, True),  # at any usage
        (NAMED, HIGH, True),
        (HOLDER, LOW, True),  # holders too: their footprint follows their prompt
        (HOLDER, HIGH, True),
        (ANON, HIGH, False),
        (WorkingSetView(waiters_ahead=1), LOW, False),  # waits its turn, unprobed
        (WorkingSetView(has_window=True, waiters_ahead=3), LOW, True),  # holders do not queue
        (NAMED, LOW_NO_BLOCKS, False),  # watermark fallback
        (NAMED, HIGH_NO_BLOCKS, True),
        (HOLDER, HIGH_NO_BLOCKS, False),
    ],
)
def test_working_set_asks_for_the_prefix_probe(view, usage, expected):
    assert asks_probe(WORKING_SET, view, usage, SETTINGS) is expected


# ---------------------------------------- working_set: the working set

# 100 blocks of 16 tokens, headroom 4: 96 usable. Plenty free in vLLM's view unless said.
# Its prefill throughput is measured (an engine that has not measured it yet admits what
# pushes no idle window out: `unpriced_admission`) and its decode step is not: holding
# costs nothing, so the work-conserving rule holds whatever the books do not fit.
ROOMY = UsageReading(0.1, 100, 100, block_size=16, prefill_tokens_per_sec=1600.0)


def tokens(count: int, hit_blocks: int = 0) -> PrefixReading:
    """A prompt of `count` tokens (full blocks of 16), `hit_blocks` of them resident."""
    total = count // 16
    return PrefixReading(total, hit_blocks, hit_blocks / total if total else 0.0, total_tokens=count)


@pytest.mark.parametrize(
    "prefix, block_size, allowance, expected",
    [
        (tokens(330), 16, 0, 21),  # 20 full blocks + a partial one
        (tokens(330), 16, 22, 22),  # 352 tokens: exactly 22 blocks
        (tokens(330), 16, 23, 23),
        (tokens(320), 16, 0, 20),
        (tokens(330), None, 500, 20),  # no block size: the prompt's full blocks
        (PrefixReading(20, 0, 0.0), 16, 17, 22),  # no token count: full blocks + the output's blocks
    ],
)
def test_footprint_blocks(prefix, block_size, allowance, expected):
    assert footprint_blocks(prefix, UsageReading(0.1, 100, 100, block_size), allowance) == expected


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, 0),
        ({"max_tokens": 16}, 16),
        ({"max_tokens": 16, "max_completion_tokens": 40}, 40),  # vLLM's order: the newer field wins
        ({"max_completion_tokens": None, "max_tokens": 16}, 16),
        ({"max_tokens": True}, 0),
        ({"max_tokens": -3}, 0),
        ({"max_tokens": "16"}, 0),
        ({"max_tokens": 2.5}, 0),
    ],
)
def test_output_allowance(body, expected):
    assert output_allowance(body) == expected


def test_working_set_holder_is_priced_behind_the_older_windows_only():
    # 60 blocks in older windows; a 36-block footprint fits 96 exactly, even with no block free
    # in vLLM's view (a holder's blocks are its own) and younger windows ignored.
    holder = WorkingSetView(has_window=True, older_window_blocks=60, idle_window_blocks=90)
    full = UsageReading(1.0, 100, 0, block_size=16)
    assert WORKING_SET.decide(holder, full, tokens(36 * 16), SETTINGS) == Admit(
        AdmissionReason.HOLDS_WINDOW, window=True, footprint=36
    )


def test_working_set_holder_that_no_longer_fits_loses_its_window():
    holder = WorkingSetView(has_window=True, older_window_blocks=60)
    decision = WORKING_SET.decide(holder, ROOMY, tokens(36 * 16 + 1), SETTINGS)  # 37 blocks: 97 > 96
    assert isinstance(decision, Wait) and decision.drop_window and decision.cause == WaitCause.WINDOW_LOST
    assert "window lost" in decision.why and "37" in decision.why and "60" in decision.why
    # the oldest holder (nothing older) always fits: it makes progress
    oldest = WorkingSetView(has_window=True, older_window_blocks=0, idle_window_blocks=95)
    assert WORKING_SET.decide(oldest, ROOMY, tokens(96 * 16), SETTINGS) == Admit(
        AdmissionReason.HOLDS_WINDOW, window=True, footprint=96
    )


def test_working_set_holder_footprint_is_refreshed_from_every_turn():
    holder = WorkingSetView(has_window=True, max_output_tokens=16)
    grown = WORKING_SET.decide(holder, ROOMY, tokens(600), SETTINGS)  # ceil(616 / 16) = 39
    shrunk = WORKING_SET.decide(holder, ROOMY, tokens(100), SETTINGS)  # ceil(116 / 16) = 8
    assert (grown.footprint, shrunk.footprint) == (39, 8)


def test_working_set_windows_are_priced_at_their_size_not_their_next_turns():
    # Its last turn was 320 tokens, this one is 480 (it grew 160 a turn): the window keeps
    # 480 tokens through the next tool call, 30 blocks, not the next turn's 40.
    grown = WorkingSetView(has_window=True, older_window_blocks=50, last_prompt_tokens=320)
    assert WORKING_SET.decide(grown, ROOMY, tokens(480), SETTINGS) == Admit(
        AdmissionReason.HOLDS_WINDOW, window=True, footprint=30
    )
    # behind 66 blocks it fits exactly (96 usable); behind 67 it loses its window
    assert WORKING_SET.decide(
        WorkingSetView(has_window=True, older_window_blocks=66, last_prompt_tokens=320), ROOMY, tokens(480), SETTINGS
    ) == Admit(AdmissionReason.HOLDS_WINDOW, window=True, footprint=30)
    behind = WorkingSetView(has_window=True, older_window_blocks=67, last_prompt_tokens=320)
    decision = WORKING_SET.decide(behind, ROOMY, tokens(480), SETTINGS)
    assert isinstance(decision, Wait) and decision.drop_window and decision.cause == WaitCause.WINDOW_LOST
    # a newcomer without history: its prompt's 30 blocks, whatever other sessions grew by
    fresh = WORKING_SET.decide(WorkingSetView(older_window_blocks=66), ROOMY, tokens(30 * 16), SETTINGS)
    assert fresh == Admit(AdmissionReason.WINDOW_FITS, window=True, footprint=30)


def test_working_set_prompt_too_long_looks_at_the_real_prompt_only():
    # 96 blocks fit 96 usable; the output allowance would not, but the footprint is capped at usable
    growing = WorkingSetView(has_window=True, last_prompt_tokens=50 * 16, max_output_tokens=64)
    assert WORKING_SET.decide(growing, ROOMY, tokens(96 * 16), SETTINGS) == Admit(
        AdmissionReason.HOLDS_WINDOW, window=True, footprint=96
    )
    assert isinstance(WORKING_SET.decide(growing, ROOMY, tokens(97 * 16), SETTINGS), Reject)


def test_working_set_newcomer_needs_both_the_books_and_vllms_view():
    prompt = tokens(30 * 16)  # 30 blocks, all cold
    # books: 66 + 30 = 96 fits; vLLM: 100 free - 60 idle - 4 headroom = 36 >= 30 fits
    assert WORKING_SET.decide(
        WorkingSetView(older_window_blocks=66, idle_window_blocks=60), ROOMY, prompt, SETTINGS
    ) == Admit(AdmissionReason.WINDOW_FITS, window=True, footprint=30)
    # books: 67 + 30 = 97 > 96, although vLLM reads everything free (windows not yet scheduled)
    books = WORKING_SET.decide(WorkingSetView(older_window_blocks=67), ROOMY, prompt, SETTINGS)
    assert isinstance(books, Wait) and not books.drop_window and books.cause == WaitCause.WINDOWS_FULL
    assert "67" in books.why
    # vLLM's view: traffic the gate does not see holds 70 blocks
    busy = UsageReading(0.7, 100, 30, block_size=16, prefill_tokens_per_sec=1600.0)
    seen = WORKING_SET.decide(WorkingSetView(), busy, prompt, SETTINGS)
    assert isinstance(seen, Wait) and seen.cause == WaitCause.NO_FREE_BLOCKS and "30 new blocks, 26 free" in seen.why
    # a resident prefix needs only its new blocks from vLLM's view, but its whole footprint in the books
    hot = tokens(30 * 16, hit_blocks=26)
    assert WORKING_SET.decide(WorkingSetView(), busy, hot, SETTINGS) == Admit(
        AdmissionReason.WINDOW_FITS, window=True, footprint=30
    )
    assert isinstance(WORKING_SET.decide(WorkingSetView(older_window_blocks=67), busy, hot, SETTINGS), Wait)


def test_working_set_burst_admits_only_what_fits_because_each_admission_counts_at_once():
    # 8 newcomers of 30 blocks arrive together; vLLM has scheduled none of them, so it reads
    # 100 free for all eight. Each admission joins the books before the next decision.
    windows: list[int] = []
    decisions = []
    for _ in range(8):
        view = WorkingSetView(older_window_blocks=sum(windows))
        decision = WORKING_SET.decide(view, ROOMY, tokens(30 * 16), SETTINGS)
        decisions.append(decision)
        if isinstance(decision, Admit):
            windows.append(decision.footprint)
    assert [d.reason if isinstance(d, Admit) else "wait" for d in decisions] == ["window_fits"] * 3 + ["wait"] * 5
    assert windows == [30, 30, 30]


def test_working_set_output_allowance_counts_in_the_footprint():
    prompt = tokens(30 * 16)
    view = WorkingSetView(older_window_blocks=60)
    assert WORKING_SET.decide(view, ROOMY, prompt, SETTINGS) == Admit(
        AdmissionReason.WINDOW_FITS, window=True, footprint=30
    )
    with_output = WorkingSetView(older_window_blocks=60, max_output_tokens=6 * 16 + 1)  # 30 + 7 = 37 blocks
    assert WORKING_SET.decide(with_output, ROOMY, prompt, SETTINGS) == Wait(
        WaitCause.WINDOWS_FULL,
        "footprint 37 blocks + 60 in windows exceeds 96 usable blocks; re-prefill 0.310s > holding cost 0.000s",
    )


def test_working_set_footprint_is_capped_at_usable_so_a_large_allowance_never_strands_a_turn():
    huge = WorkingSetView(max_output_tokens=1_000_000)
    assert WORKING_SET.decide(huge, ROOMY, tokens(160), SETTINGS) == Admit(
        AdmissionReason.WINDOW_FITS, window=True, footprint=96
    )
    assert isinstance(
        WORKING_SET.decide(
            WorkingSetView(older_window_blocks=1, max_output_tokens=1_000_000), ROOMY, tokens(160), SETTINGS
        ),
        Wait,
    )


def test_working_set_prompt_too_long_for_holders_too():
    decision = WORKING_SET.decide(HOLDER, ROOMY, tokens(97 * 16), SETTINGS)
    assert isinstance(decision, Reject) and decision.code == RejectCode.PROMPT_TOO_LONG


def test_working_set_newcomers_wait_in_fifo_order_holders_do_not():
    # unmeasured, the rule cannot admit it without a window: it waits for its place, unprobed
    unmeasured = replace(ROOMY, prefill_tokens_per_sec=None)
    behind = WORKING_SET.decide(WorkingSetView(waiters_ahead=2), unmeasured, None, SETTINGS)
    assert behind == Wait(WaitCause.BEHIND_WAITERS, "behind 2 waiting sessions (first come, first served)", poll=False)
    holder = WorkingSetView(has_window=True, waiters_ahead=2)
    assert WORKING_SET.decide(holder, ROOMY, tokens(160), SETTINGS) == Admit(
        AdmissionReason.HOLDS_WINDOW, window=True, footprint=10
    )
    # the fallbacks ignore the queue, as the watermark policy does
    assert WORKING_SET.decide(WorkingSetView(waiters_ahead=2), LOW_NO_BLOCKS, None, SETTINGS) == Admit(
        AdmissionReason.OPEN, wake_next=True
    )


# ------------------------------------------ no-pressure path (bounded price)

SMALL_BLOCKS = UsageReading(0.3, 100, 70, block_size=16)


def test_prompt_token_bound_is_the_body_bytes_plus_the_template_margin():
    body = b'{"messages":[{"role":"user","content":"hi"}]}'
    assert prompt_token_bound(body) == len(body) + TEMPLATE_MARGIN_TOKENS
    # a quoted marker inside a message is escaped by JSON, so it is still text
    assert prompt_token_bound(b'{"content":"say \\"type\\":\\"image\\""}') is not None
    assert prompt_token_bound(b'{"content":[{"type":"image_url","image_url":{"url":"u"}}]}') is None
    assert prompt_token_bound(b'{"content":[{"type":"input_audio"}]}') is None


@pytest.mark.parametrize("marker", _MEDIA_MARKERS)
def test_any_media_marker_anywhere_in_a_long_body_means_no_bound(marker):
    text = b'{"type":"text","text":"' + b"word " * 2000 + b'"},'
    assert prompt_token_bound(b'{"content":[' + text * 5 + b"{" + marker + b"}]}") is None
    assert prompt_token_bound(b'{"content":[' + text * 5 + b'{"type":"text"}]}') is not None


def test_the_one_media_scan_finds_what_a_test_per_marker_finds():
    """The scan's factored alternation against the plain reading of its markers, on every
    marker, each with its last byte cut (a near miss), and each behind a near miss of
    another (the scan resumes inside a partial match)."""
    pieces = [*_MEDIA_MARKERS, *(marker[:-1] for marker in _MEDIA_MARKERS), b'"type":"text"', b'"typ', b'"']
    for first in pieces:
        for second in pieces:
            body = b"{" + first + second + b"}"
            assert (prompt_token_bound(body) is None) == any(marker in body for marker in _MEDIA_MARKERS), body


@pytest.mark.parametrize(
    "view, expected",
    [
        (WorkingSetView(prompt_bound_tokens=600), 38),  # ceil(600 / 16)
        (WorkingSetView(prompt_bound_tokens=600, max_output_tokens=32), 40),  # + the output allowance
        (
            WorkingSetView(prompt_bound_tokens=600, last_prompt_tokens=500, last_prompt_bound=550),
            38,
        ),  # history: 500 + 50 bytes of growth + the margin = 614 > 600, the body's bound
        (
            WorkingSetView(prompt_bound_tokens=600, last_prompt_tokens=400, last_prompt_bound=550),
            33,
        ),  # 400 + 50 + 64 = 514 tokens
        (WorkingSetView(prompt_bound_tokens=600, other_window_blocks=62), 38),  # 38 + 62 = 100: fits
        (WorkingSetView(prompt_bound_tokens=600, other_window_blocks=63), None),  # 101 > 100: probe
        (
            WorkingSetView(has_window=True, prompt_bound_tokens=600, older_window_blocks=0, other_window_blocks=63),
            None,
        ),  # the oldest holder too: at its bound it would crowd the younger windows out
        (WorkingSetView(prompt_bound_tokens=600, idle_window_blocks=33), 38),  # 37 prompt blocks <= 70 - 33
        (WorkingSetView(prompt_bound_tokens=600, idle_window_blocks=34), None),  # 37 > 70 - 34: vLLM's view says no
        (
            WorkingSetView(has_window=True, prompt_bound_tokens=600, idle_window_blocks=60),
            38,
        ),  # holders skip vLLM's view
        (WorkingSetView(prompt_bound_tokens=None), None),  # media: always probe
    ],
)
def test_bounded_footprint(view, expected):
    assert bounded_footprint(view, SMALL_BLOCKS, GateSettings()) == expected


@pytest.mark.parametrize(
    "view, expected",
    [
        (WorkingSetView(prompt_bound_tokens=None, last_prompt_tokens=100, last_prompt_bound=600), None),  # media
        (WorkingSetView(prompt_bound_tokens=3000), 3000),  # no history
        (
            WorkingSetView(prompt_bound_tokens=3000, last_prompt_tokens=500, last_prompt_bound=2600),
            500 + 400 + HISTORY_MARGIN_TOKENS,
        ),  # exact size + byte growth
        (
            WorkingSetView(prompt_bound_tokens=2000, last_prompt_tokens=500, last_prompt_bound=2600),
            500 + HISTORY_MARGIN_TOKENS,
        ),  # a shrunk body adds nothing
        (
            WorkingSetView(prompt_bound_tokens=700, last_prompt_tokens=650, last_prompt_bound=690),
            700,
        ),  # never above the body's
    ],
)
def test_history_bound(view, expected):
    assert history_bound(view) == expected


def test_working_set_admits_a_bounded_turn_without_the_probe_and_prices_it_at_the_bound():
    # 100 usable blocks: the exact price is asked for once the windows hold more than 50
    view = WorkingSetView(prompt_bound_tokens=600)
    assert not asks_probe(WORKING_SET, view, SMALL_BLOCKS, GateSettings())
    assert working_set_decide(view, SMALL_BLOCKS, None, GateSettings()) == Admit(
        AdmissionReason.WINDOW_FITS, window=True, footprint=38, reprice_above=50
    )
    holder = WorkingSetView(has_window=True, prompt_bound_tokens=600)
    assert working_set_decide(holder, SMALL_BLOCKS, None, GateSettings()) == Admit(
        AdmissionReason.HOLDS_WINDOW, window=True, footprint=38, reprice_above=50
    )
    # headroom comes off the usable blocks first: (100 - 4) // 2
    assert working_set_decide(view, SMALL_BLOCKS, None, SETTINGS).reprice_above == 48
    # a body without a bound is priced exactly, from its prefix reading: final
    assert working_set_decide(WorkingSetView(), ROOMY, tokens(600), SETTINGS).reprice_above is None
    crowded = WorkingSetView(prompt_bound_tokens=600, older_window_blocks=80, other_window_blocks=80)
    assert asks_probe(WORKING_SET, crowded, SMALL_BLOCKS, GateSettings())


def test_a_holder_is_priced_exactly_where_its_bound_would_crowd_younger_windows_out():
    """The oldest holder's bound (38 blocks) fits behind the older windows (none) but not
    beside the younger ones (70): it is probed, and at its exact price (8 blocks) keeps its
    window beside them, where the bound would have taken 38 + 70 > 100 blocks of the books
    and the younger sessions would have lost theirs at their next turns."""
    holder = WorkingSetView(has_window=True, prompt_bound_tokens=600, older_window_blocks=0, other_window_blocks=70)
    usage = replace(SMALL_BLOCKS, prefill_tokens_per_sec=1600.0)
    assert asks_probe(WORKING_SET, holder, usage, GateSettings())
    exact = working_set_decide(holder, usage, tokens(7 * 16, hit_blocks=5), GateSettings())
    assert exact == Admit(AdmissionReason.HOLDS_WINDOW, window=True, footprint=7)
    younger = WorkingSetView(has_window=True, older_window_blocks=exact.footprint, other_window_blocks=7 + 60)
    assert working_set_decide(younger, usage, tokens(30 * 16, hit_blocks=25), GateSettings()).window


# ------------------------------------------------- invariants, registry


VIEWS = [
    NAMED,
    HOLDER,
    ANON,
    WorkingSetView(idle_window_blocks=50),
    WorkingSetView(has_window=True, idle_window_blocks=5),
    WorkingSetView(waiters_ahead=2),
    WorkingSetView(has_window=True, waiters_ahead=2, older_window_blocks=90),
    WorkingSetView(older_window_blocks=80, max_output_tokens=64),
    WorkingSetView(anonymous=True, waiters_ahead=1),
    WorkingSetView(prompt_bound_tokens=600),
    WorkingSetView(has_window=True, prompt_bound_tokens=600, older_window_blocks=40),
    WorkingSetView(prompt_bound_tokens=600, idle_window_blocks=60),
    WorkingSetView(prompt_bound_tokens=600, waiters_ahead=1),
    # behind others and cheap enough to go in unprobed (unprobed_work_conserving) under the
    # measured usage below
    WorkingSetView(prompt_bound_tokens=300, waiters_ahead=1, max_output_tokens=64),
    # priced at an observed tokens-per-byte ratio (unprobed_work_conserving's estimate)
    WorkingSetView(prompt_bound_tokens=1512, older_window_blocks=80, max_output_tokens=32, tokens_per_byte=0.25),
    WorkingSetView(prompt_bound_tokens=1512, waiters_ahead=1, tokens_per_byte=0.25, last_prompt_tokens=100),
]
USAGES = [
    None,
    LOW,
    AT,
    HIGH,
    LOW_NO_BLOCKS,
    HIGH_NO_BLOCKS,
    UsageReading(0.0, 100, 100),
    UsageReading(1.0, 100, 0),
    UsageReading(0.3, 100, 70, block_size=16),
    UsageReading(0.9, 100, 10, 16, prefill_tokens_per_sec=16000.0, decode_step_sec=0.01),  # work-conserving
]
PREFIXES = [
    PREFIX_UNAVAILABLE,
    COLD,
    HOT,
    EDGE,
    PrefixReading(400, 0, 0.0),
    PrefixReading(20, 0, 0.0, total_tokens=330),
]
READINGS = [prefix for prefix in PREFIXES if isinstance(prefix, PrefixReading)]


def answers(policy, view, usage):
    """The policy's answers to the turn with every prefix answer of PREFIXES (as the gate
    decides after the probe: never ProbeFirst)."""
    return {policy.decide_read(policy.view(view), usage, prefix, SETTINGS) for prefix in PREFIXES}


@pytest.mark.parametrize(
    "policy, unprobed, probed", [(WATERMARK, 110, 50), (WORKING_SET, 81, 79)], ids=["watermark", "working_set"]
)
def test_probe_first_exactly_when_the_prefix_would_change_the_answer(policy, unprobed, probed):
    """Decided without a prefix reading, a policy answers ProbeFirst only when some prefix
    answer gives another decision, and otherwise the decision every prefix answer gives."""
    seen = {"unprobed": 0, "probed": 0}
    for view, usage in itertools.product(VIEWS, USAGES):
        first = policy.decide(policy.view(view), usage, None, SETTINGS)
        if isinstance(first, ProbeFirst):
            assert len(answers(policy, view, usage)) > 1, (view, usage)
            seen["probed"] += 1
        else:
            assert answers(policy, view, usage) == {first}, (view, usage, first)
            seen["unprobed"] += 1
    assert seen == {"unprobed": unprobed, "probed": probed}


@pytest.mark.parametrize("policy, waits", [(WATERMARK, 200), (WORKING_SET, 304)], ids=["watermark", "working_set"])
def test_fewer_hits_never_turn_a_wait_into_an_admission(policy, waits):
    """What the gate relies on to re-decide a held turn on its last reading (hits only fall
    while a turn waits, HELD_READING_MAX_AGE_SEC): a prompt that waits with some of its
    blocks resident also waits with fewer of them resident."""
    checked = 0
    for view, usage, prefix in itertools.product(VIEWS, USAGES, READINGS):
        if not isinstance(policy.decide_read(policy.view(view), usage, prefix, SETTINGS), Wait):
            continue
        checked += 1
        for hit in range(prefix.hit_blocks):
            colder = PrefixReading(prefix.total_blocks, hit, hit / prefix.total_blocks, prefix.total_tokens)
            decision = policy.decide_read(policy.view(view), usage, colder, SETTINGS)
            assert isinstance(decision, Wait), (view, usage, prefix, hit)
    assert checked == waits


@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
def test_anonymous_never_holds_a_window(policy):
    anonymous = policy.view(ANON)
    cases = 0
    for usage, prefix in itertools.product(USAGES, [None, *PREFIXES]):
        decision = policy.decide(anonymous, usage, prefix, SETTINGS)
        assert not isinstance(decision, ProbeFirst)  # the watermark alone decides an anonymous turn
        assert not (isinstance(decision, Admit) and decision.window)
        cases += 1
    assert cases == len(USAGES) * (1 + len(PREFIXES))


def test_registry():
    assert set(POLICIES) == {"watermark", "working_set"}
    assert get_policy("watermark") is WATERMARK and get_policy("working_set") is WORKING_SET
    with pytest.raises(ValueError, match="unknown gate.policy 'nope'; choose one of: watermark, working_set"):
        get_policy("nope")


@pytest.mark.parametrize("old,new", [("seed", "watermark"), ("contract", "working_set")])
def test_a_renamed_policy_is_refused_with_its_new_name(old, new):
    with pytest.raises(ValueError, match=f"gate.policy {old!r} was renamed {new!r}"):
        get_policy(old)


def test_every_view_field_is_a_fact_of_the_same_name():
    """`WorkingSetView.read` reads each field off the fact of its name: the protocol and the
    shell's facts must offer every one (a new field without its fact fails here, not at run time)."""
    from dataclasses import fields

    from kvgate.gate.policies.views import GateFacts, WatermarkView
    from kvgate.gate.turn_facts import TurnFacts

    for view in (WorkingSetView, WatermarkView):
        for name in (f.name for f in fields(view)):
            assert hasattr(GateFacts, name), f"GateFacts lacks {name}"
            assert hasattr(TurnFacts, name), f"TurnFacts lacks {name}"
