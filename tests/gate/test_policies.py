"""The decision policies as pure functions: every branch, no event loop."""

from __future__ import annotations

import itertools

import pytest

from gate.policies import (
    ANONYMOUS, CONTRACT, CONTRACT_FITS, OPEN, POLICIES, PREFIX_PROBE_UNAVAILABLE, PROMPT_TOO_LONG,
    RESERVED_SESSION, RESIDENT_PREFIX, SEED, Admit, GateView, Reject, Wait, get_policy,
)
from gate.readings import PrefixReading, UsageReading
from proxy.settings import GateSettings

KNOBS = GateSettings(high_watermark=0.85, hit_threshold=0.80, headroom_blocks=4)
LOW = UsageReading(0.5, 100, 50)
HIGH = UsageReading(0.9, 100, 10)
AT = UsageReading(0.85, 100, 15)
HIGH_NO_BLOCKS = UsageReading(0.9, source="metrics")
LOW_NO_BLOCKS = UsageReading(0.5, source="metrics")
COLD = PrefixReading(total_blocks=20, hit_blocks=2, hit_ratio=0.1)
HOT = PrefixReading(total_blocks=20, hit_blocks=18, hit_ratio=0.9)
EDGE = PrefixReading(total_blocks=10, hit_blocks=8, hit_ratio=0.8)

NAMED = GateView()
RESERVED = GateView(reserved=True)
ANON = GateView(anonymous=True)


# ------------------------------------------------------------------ seed


@pytest.mark.parametrize(
    "view, usage, prefix, expected",
    [
        (NAMED, None, None, Admit(OPEN)),                                  # usage unknown
        (RESERVED, None, None, Admit(OPEN, reserve=True)),                 # ... keeps its window
        (ANON, None, None, Admit(OPEN)),
        (ANON, LOW, None, Admit(ANONYMOUS)),                               # anonymous below
        (ANON, HIGH, HOT, Wait("anonymous request above the watermark")),  # anonymous above: watermark only
        (NAMED, LOW, None, Admit(OPEN)),                                   # below the watermark
        (RESERVED, LOW, None, Admit(OPEN, reserve=True)),                  # window kept and renewed
        (RESERVED, HIGH, None, Admit(RESERVED_SESSION, reserve=True)),
        (NAMED, HIGH, None, Admit(PREFIX_PROBE_UNAVAILABLE)),
        (NAMED, HIGH, HOT, Admit(RESIDENT_PREFIX, reserve=True, resident_blocks=20)),
        (NAMED, AT, EDGE, Admit(RESIDENT_PREFIX, reserve=True, resident_blocks=10)),  # >= at both edges
        (NAMED, HIGH, COLD, Wait("cold prefix above the watermark")),
    ],
)
def test_seed_decide(view, usage, prefix, expected):
    assert SEED.decide(view, usage, prefix, KNOBS) == expected


def test_seed_without_retain_session_never_reserves():
    knobs = GateSettings(retain_session=False)
    assert SEED.decide(NAMED, HIGH, HOT, knobs) == Admit(RESIDENT_PREFIX, reserve=False, resident_blocks=20)
    assert SEED.decide(RESERVED, HIGH, None, knobs) == Admit(RESERVED_SESSION, reserve=False)
    assert SEED.decide(RESERVED, LOW, None, knobs) == Admit(OPEN, reserve=False)


@pytest.mark.parametrize(
    "view, usage, expected",
    [
        (NAMED, None, False),
        (NAMED, LOW, False),
        (NAMED, AT, True),
        (NAMED, HIGH, True),
        (RESERVED, HIGH, False),
        (ANON, HIGH, False),
    ],
)
def test_seed_asks_prefix_only_above_watermark_for_unreserved_sessions(view, usage, expected):
    assert SEED.needs_prefix_probe(view, usage, KNOBS) is expected


# -------------------------------------------------------------- contract


@pytest.mark.parametrize(
    "view, usage, prefix, expected",
    [
        (NAMED, None, None, Admit(OPEN)),
        (RESERVED, None, None, Admit(OPEN, reserve=True)),
        (ANON, LOW, None, Admit(ANONYMOUS)),
        (ANON, HIGH, None, Wait("anonymous request above the watermark")),
        (RESERVED, LOW, None, Admit(RESERVED_SESSION, reserve=True)),     # at any usage
        (RESERVED, HIGH, None, Admit(RESERVED_SESSION, reserve=True)),
        # no block counts (/metrics fallback): the seed policy decides
        (NAMED, LOW_NO_BLOCKS, None, Admit(OPEN)),
        (NAMED, HIGH_NO_BLOCKS, None, Admit(PREFIX_PROBE_UNAVAILABLE)),
        # prefix probe failed: the seed policy decides
        (NAMED, LOW, None, Admit(OPEN)),
        (NAMED, HIGH, None, Admit(PREFIX_PROBE_UNAVAILABLE)),
    ],
)
def test_contract_decide_fallbacks(view, usage, prefix, expected):
    assert CONTRACT.decide(view, usage, prefix, KNOBS) == expected


def test_contract_hand_worked_budget():
    # 100 usable blocks, 40 free, 10 held by idle windows, headroom 4: budget 26.
    usage = UsageReading(0.6, 100, 40)
    view = GateView(idle_reserved_blocks=10)
    fits = PrefixReading(total_blocks=30, hit_blocks=4, hit_ratio=4 / 30)      # 26 new: fits exactly
    over = PrefixReading(total_blocks=30, hit_blocks=3, hit_ratio=0.1)         # 27 new: waits
    assert CONTRACT.decide(view, usage, fits, KNOBS) == Admit(CONTRACT_FITS, reserve=True, resident_blocks=30)
    decision = CONTRACT.decide(view, usage, over, KNOBS)
    assert isinstance(decision, Wait) and "27" in decision.why and "26" in decision.why


def test_contract_waits_below_watermark_when_idle_windows_hold_the_free_blocks():
    # usage reads 20% yet the free blocks are idle sessions' prefixes: the watermark is fooled, contract is not.
    usage = UsageReading(0.2, 100, 80)
    view = GateView(idle_reserved_blocks=70)
    prompt = PrefixReading(total_blocks=12, hit_blocks=0, hit_ratio=0.0)
    assert isinstance(CONTRACT.decide(view, usage, prompt, KNOBS), Wait)
    assert SEED.decide(view, usage, prompt, KNOBS) == Admit(OPEN)


def test_contract_hot_prefix_needs_only_its_new_blocks():
    usage = UsageReading(0.95, 100, 6)
    assert CONTRACT.decide(NAMED, usage, HOT, KNOBS) == Admit(CONTRACT_FITS, reserve=True, resident_blocks=20)


@pytest.mark.parametrize("total, rejected", [(96, False), (97, True), (500, True)])
def test_contract_prompt_too_long_against_usable_blocks(total, rejected):
    # usable = 100 total - 4 headroom = 96
    prompt = PrefixReading(total_blocks=total, hit_blocks=0, hit_ratio=0.0)
    decision = CONTRACT.decide(NAMED, UsageReading(0.0, 100, 100), prompt, KNOBS)
    if rejected:
        assert isinstance(decision, Reject) and decision.code == PROMPT_TOO_LONG
        assert str(total) in decision.message and "headroom_blocks" in decision.message
    else:
        assert decision == Admit(CONTRACT_FITS, reserve=True, resident_blocks=total)


def test_contract_without_retain_session_does_not_reserve():
    knobs = GateSettings(retain_session=False)
    assert CONTRACT.decide(NAMED, LOW, COLD, knobs) == Admit(CONTRACT_FITS, reserve=False, resident_blocks=20)


@pytest.mark.parametrize(
    "view, usage, expected",
    [
        (NAMED, None, False),
        (NAMED, LOW, True),       # at any usage
        (NAMED, HIGH, True),
        (RESERVED, HIGH, False),
        (ANON, HIGH, False),
        (NAMED, LOW_NO_BLOCKS, False),   # seed fallback
        (NAMED, HIGH_NO_BLOCKS, True),
    ],
)
def test_contract_needs_prefix_probe(view, usage, expected):
    assert CONTRACT.needs_prefix_probe(view, usage, KNOBS) is expected


# ------------------------------------------------- invariants, registry


VIEWS = [NAMED, RESERVED, ANON, GateView(idle_reserved_blocks=50), GateView(reserved=True, idle_reserved_blocks=5)]
USAGES = [None, LOW, AT, HIGH, LOW_NO_BLOCKS, HIGH_NO_BLOCKS, UsageReading(0.0, 100, 100), UsageReading(1.0, 100, 0)]
PREFIXES = [None, COLD, HOT, EDGE, PrefixReading(400, 0, 0.0)]


@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
def test_decision_does_not_depend_on_a_prefix_probe_it_did_not_ask_for(policy):
    for view, usage in itertools.product(VIEWS, USAGES):
        if policy.needs_prefix_probe(view, usage, KNOBS):
            continue
        answers = {policy.decide(view, usage, prefix, KNOBS) for prefix in PREFIXES}
        assert len(answers) == 1, (view, usage, answers)


@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
def test_anonymous_is_never_reserved(policy):
    for usage, prefix in itertools.product(USAGES, PREFIXES):
        decision = policy.decide(ANON, usage, prefix, KNOBS)
        assert not (isinstance(decision, Admit) and decision.reserve)


def test_registry():
    assert set(POLICIES) == {"seed", "contract"}
    assert get_policy("seed") is SEED and get_policy("contract") is CONTRACT
    with pytest.raises(ValueError, match="unknown gate.policy 'nope'; choose one of: contract, seed"):
        get_policy("nope")
