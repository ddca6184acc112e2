"""The agent trace generator: pure and seeded, and its statistics are the published ones."""

import math
import random
import statistics

import pytest

from kvgate.simulator.agent_trace import TOOL_TIME_FIT, AgentTraceSpec, Lognormal, generate_trace

# Large enough that each statistic's sampling error is well inside its tolerance.
BIG = AgentTraceSpec(sessions=6000)


@pytest.fixture(scope="module")
def big():
    return generate_trace(BIG, 3)


def test_same_seed_same_trace_other_seed_other_trace():
    spec = AgentTraceSpec(sessions=20)
    assert generate_trace(spec, 1) == generate_trace(spec, 1)
    assert generate_trace(spec, 1) != generate_trace(spec, 2)


def test_mean_turns_per_session_is_the_published_17_9(big):
    mean = statistics.mean(len(s.turns) for s in big.sessions)
    assert mean == pytest.approx(17.9, rel=0.03)
    assert all(1 <= len(s.turns) <= BIG.turns_max for s in big.sessions)


def test_median_prompt_and_output_per_turn_are_the_published_ones(big):
    prompts = [p for s in big.sessions for p in big.prompt_tokens(s)]
    outputs = [t.output_tokens for s in big.sessions for t in s.turns]
    assert statistics.median(prompts) == pytest.approx(6945, rel=0.03)
    assert statistics.median(outputs) == pytest.approx(30, abs=1)


def test_follow_ups_86_percent_within_1s_and_95_within_10s_with_a_heavy_tail(big):
    gaps = [t.tool_time_s for s in big.sessions for t in s.turns[:-1]]
    within = lambda limit: sum(g <= limit for g in gaps) / len(gaps)  # noqa: E731
    assert within(1.0) == pytest.approx(0.86, abs=0.01)
    assert within(10.0) == pytest.approx(0.95, abs=0.01)
    assert statistics.median(gaps) < 0.05  # most follow-ups are near-immediate ...
    assert max(gaps) == BIG.tool_time_max_s  # ... and the tail reaches the clamp
    assert statistics.mean(gaps) > 20 * statistics.median(gaps)


def test_every_session_shares_the_system_prompt_and_its_last_turn_has_no_tool_call(big):
    assert big.system_prompt_tokens == BIG.system_prompt_tokens
    for session in big.sessions[:50]:
        assert big.prompt_tokens(session)[0] == BIG.system_prompt_tokens + BIG.task_tokens
        assert session.turns[-1].tool_result_tokens == 0 and session.turns[-1].tool_time_s == 0
        assert all(t.tool_result_tokens >= 1 for t in session.turns[:-1])


def test_token_scale_divides_every_token_count_and_keeps_the_turns():
    spec = AgentTraceSpec(sessions=300)
    plain, scaled = generate_trace(spec, 5), generate_trace(spec.replace(token_scale=8), 5)
    assert [len(s.turns) for s in plain.sessions] == [len(s.turns) for s in scaled.sessions]
    assert scaled.system_prompt_tokens == spec.system_prompt_tokens / 8
    plain_prompts = [p for s in plain.sessions for p in plain.prompt_tokens(s)]
    scaled_prompts = [p for s in scaled.sessions for p in scaled.prompt_tokens(s)]
    assert statistics.median(scaled_prompts) == pytest.approx(statistics.median(plain_prompts) / 8, rel=0.05)
    outputs = [t.output_tokens for s in scaled.sessions for t in s.turns]
    assert statistics.median(outputs) == pytest.approx(30 / 8, abs=1)
    assert min(outputs) >= 1


def test_time_scale_stretches_tool_times_only():
    spec = AgentTraceSpec(sessions=30)
    plain, slow = generate_trace(spec, 4), generate_trace(spec.replace(time_scale=3), 4)
    for a, b in zip(plain.sessions, slow.sessions):
        assert [t.output_tokens for t in a.turns] == [t.output_tokens for t in b.turns]
        assert [3 * t.tool_time_s for t in a.turns] == pytest.approx([t.tool_time_s for t in b.turns])


def test_lognormal_fit_from_two_quantiles():
    fit = Lognormal.from_quantiles(0.86, 1.0, 0.95, 10.0)
    assert fit == TOOL_TIME_FIT
    assert fit.cdf(1.0) == pytest.approx(0.86) and fit.cdf(10.0) == pytest.approx(0.95)
    assert Lognormal.from_mean(17.9, 0.7).median == pytest.approx(17.9 / math.exp(0.245))
    clamped = Lognormal(1.0, 3.0, low=0.5, high=2.0)
    rng = random.Random(0)
    assert all(0.5 <= clamped.sample(rng) <= 2.0 for _ in range(200))
    with pytest.raises(ValueError):
        Lognormal.from_quantiles(0.95, 1.0, 0.86, 10.0)


@pytest.mark.parametrize("field,value", [("sessions", 0), ("agents", 0), ("token_scale", 0.5), ("turns_mean", 0)])
def test_bad_spec_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        generate_trace(AgentTraceSpec().replace(**{field: value}), 0)


def test_replace_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown"):
        AgentTraceSpec().replace(sesions=3)
