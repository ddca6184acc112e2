"""The simulated replica's reply plan: sampled lengths capped by max_tokens, natural stops,
tool calls at a rate, deterministic under a seed (simulator/reply_model.py)."""

import math
import statistics

import jsonschema
import pytest

from kvgate.simulator.config import ConfigError
from kvgate.simulator.reply_model import (
    FIXED_LENGTHS,
    ReplyModel,
    ReplyPlan,
    ToolCall,
    arguments_slice,
    function_tools,
    plan_reply,
    tool_offer,
)

READ = {
    "type": "object",
    "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["file_path"],
}
OFFER = tool_offer(function_tools([{"name": "Read", "input_schema": READ}], "messages"), None)


def prompts(count: int) -> list[list[int]]:
    return [[1, 2, 3, index, index * 7] for index in range(count)]


def test_lengths_are_lognormal_around_the_median_and_stop_naturally():
    model = ReplyModel(median_tokens=100, sigma=0.8)
    plans = [plan_reply(model, prompt, 100_000) for prompt in prompts(2000)]
    lengths = [plan.tokens for plan in plans]
    assert all(plan.natural_stop and plan.finish_reason == "stop" for plan in plans)
    assert 90 <= statistics.median(lengths) <= 110
    spread = statistics.stdev(math.log(length) for length in lengths)
    assert 0.7 <= spread <= 0.9
    assert len(set(lengths)) > 100


def test_max_tokens_caps_the_reply_and_only_a_cut_reply_finishes_with_length():
    model = ReplyModel(median_tokens=100, sigma=0.8)
    plans = [plan_reply(model, prompt, 100, OFFER) for prompt in prompts(500)]
    cut = [plan for plan in plans if not plan.natural_stop]
    assert 150 < len(cut) < 350  # about half the draws exceed the median
    assert all(plan.tokens == 100 and plan.finish_reason == "length" and plan.tool_call is None for plan in cut)
    assert all(plan.tokens < 100 for plan in plans if plan.natural_stop)


def test_same_seed_and_prompt_same_plan_other_seed_other_plans():
    model = ReplyModel(seed=3)
    assert [plan_reply(model, p, 4000, OFFER) for p in prompts(50)] == [
        plan_reply(ReplyModel(seed=3), p, 4000, OFFER) for p in prompts(50)
    ]
    other = [plan_reply(ReplyModel(seed=4), p, 4000, OFFER) for p in prompts(50)]
    assert other != [plan_reply(model, p, 4000, OFFER) for p in prompts(50)]


@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_tool_calls_come_at_the_configured_rate_with_valid_arguments(rate):
    plans = [plan_reply(ReplyModel(tool_call_rate=rate), p, 100_000, OFFER) for p in prompts(400)]
    calls = [plan.tool_call for plan in plans if plan.tool_call is not None]
    assert abs(len(calls) / len(plans) - rate) < 0.08
    for call in calls:
        assert call.name == "Read" and len(call.key) == 24
        jsonschema.validate(call.input, READ)
    assert all(plan.finish_reason == "tool_calls" for plan in plans if plan.tool_call is not None)


def test_tool_choice_none_never_calls_and_a_forced_tool_always_does():
    tools = function_tools(
        [
            {"type": "function", "function": {"name": "a", "parameters": READ}},
            {"type": "function", "function": {"name": "b", "parameters": READ}},
        ],
        "chat",
    )
    none = tool_offer(tools, "none")
    named = tool_offer(tools, {"type": "function", "function": {"name": "b"}})
    required = tool_offer(tools, "required")
    model = ReplyModel(tool_call_rate=0.5)
    assert all(plan_reply(model, p, 100_000, none).tool_call is None for p in prompts(100))
    assert {plan_reply(model, p, 100_000, named).tool_call.name for p in prompts(100)} == {"b"}
    assert {plan_reply(model, p, 100_000, required).tool_call.name for p in prompts(100)} == {"a", "b"}


def test_function_tools_per_api_skip_other_tools():
    assert [
        t.name
        for t in function_tools(
            [{"type": "web_search_20250305", "name": "web_search"}, {"name": "Read", "input_schema": READ}], "messages"
        )
    ] == ["Read"]
    assert [
        t.name
        for t in function_tools(
            [{"type": "web_search"}, {"type": "function", "name": "f", "parameters": READ}], "responses"
        )
    ] == ["f"]
    assert tool_offer([], "required").candidates() == ()


def test_fixed_lengths_answer_exactly_max_tokens_as_before():
    for plan in (plan_reply(FIXED_LENGTHS, [1, 2], 7, OFFER), plan_reply(ReplyModel(), [1, 2], 7, OFFER, fixed=True)):
        assert plan == ReplyPlan(7, natural_stop=False)


def test_min_tokens_ends_a_fixed_reply_under_a_higher_cap_and_floors_a_sampled_one():
    """An agent's cap far above its reply: fixed lengths stop at vLLM's `min_tokens`, as a
    model that ends as soon as it may; `ignore_eos` still runs to the cap; a sampled reply
    is never shorter than the floor."""
    assert plan_reply(FIXED_LENGTHS, [1, 2], 1024, OFFER, min_tokens=8) == ReplyPlan(8, natural_stop=True)
    assert plan_reply(FIXED_LENGTHS, [1, 2], 8, OFFER, min_tokens=8) == ReplyPlan(8, natural_stop=False)
    assert plan_reply(FIXED_LENGTHS, [1, 2], 1024, OFFER, fixed=True, min_tokens=8) == ReplyPlan(1024, False)
    assert plan_reply(ReplyModel(median_tokens=1), [1, 2], 1024, min_tokens=40).tokens == 40


def test_a_streamed_call_spreads_its_arguments_over_the_reply():
    call = ToolCall("0" * 24, "Read", '{"file_path":"src/main.py"}')
    total = 9
    pieces = [arguments_slice(call, now - 1, now, total) for now in range(1, total + 1)]
    assert "".join(pieces) == call.arguments and sum(1 for piece in pieces if piece) > 3


def test_invalid_settings_are_rejected():
    for bad in (ReplyModel(lengths="fixed"), ReplyModel(median_tokens=0), ReplyModel(tool_call_rate=1.5)):
        with pytest.raises(ConfigError):
            bad.validate()


def test_a_tool_call_costs_the_tokens_of_the_text_it_replaces():
    for prompt in prompts(100):
        text = plan_reply(ReplyModel(tool_call_rate=0.0), prompt, 100_000, OFFER)
        call = plan_reply(ReplyModel(tool_call_rate=1.0), prompt, 100_000, OFFER)
        assert call.tool_call is not None and text.tool_call is None
        assert call.tokens == text.tokens
