"""The agentic workload: deterministic per seed, shaped by its spec, prefix-stable histories."""

import pytest

from kvgate.bench.agentic.workload import WorkloadSpec, build_messages, generate_workload

SPEC = WorkloadSpec(
    sessions=5, concurrency=2, turns_min=2, turns_max=6, tool_tail_prob=0.3, tool_tail_s=4.0, retry_prob=0.5
)


def test_same_seed_same_workload():
    assert generate_workload(SPEC, 7) == generate_workload(SPEC, 7)


def test_other_seed_other_workload():
    assert generate_workload(SPEC, 7).sessions != generate_workload(SPEC, 8).sessions


def test_spec_shapes_the_sessions():
    workload = generate_workload(SPEC, 1)
    assert len(workload.sessions) == 5
    assert len({s.session_id for s in workload.sessions}) == 5
    assert len({s.system_prompt for s in workload.sessions}) == 1  # shared by default
    for session in workload.sessions:
        assert 2 <= len(session.turns) <= 6
        assert [t.index for t in session.turns] == list(range(1, len(session.turns) + 1))
        assert session.turns[-1].tool_result is None and session.turns[-1].tool_latency_s == 0
        for turn in session.turns[:-1]:
            assert SPEC.tool_result_words_min <= len(turn.tool_result.split()) <= SPEC.tool_result_words_max
        for turn in session.turns:
            if turn.retry_after_s is not None:
                assert SPEC.retry_after_s_min <= turn.retry_after_s <= SPEC.retry_after_s_max
    latencies = [t.tool_latency_s for s in workload.sessions for t in s.turns[:-1]]
    assert any(x >= SPEC.tool_tail_s for x in latencies)  # the heavy tail is drawn
    assert any(x < SPEC.tool_tail_s for x in latencies)


def test_private_system_prompts():
    workload = generate_workload(SPEC.replace(shared_system_prompt=False), 1)
    assert len({s.system_prompt for s in workload.sessions}) == 5


def test_history_grows_by_reply_and_tool_result():
    session = generate_workload(SPEC, 2).sessions[0]
    replies = [f"reply {i}" for i in range(len(session.turns))]
    previous = build_messages(session, replies, 1)
    for turn in session.turns[1:]:
        messages = build_messages(session, replies, turn.index)
        assert messages[: len(previous)] == previous
        assert messages[len(previous)] == {"role": "assistant", "content": replies[turn.index - 2]}
        assert messages[-1]["content"].endswith(session.turns[turn.index - 2].tool_result)
        previous = messages


def test_build_messages_needs_earlier_replies():
    session = generate_workload(SPEC, 2).sessions[0]
    with pytest.raises(ValueError, match="earlier replies"):
        build_messages(session, [], 2)


@pytest.mark.parametrize(
    "field,value",
    [
        ("sessions", 0),
        ("turns_max", 0),
        ("tool_tail_prob", 1.5),
        ("retry_after_s_max", 0.0),
        ("subagent_prob", -0.1),
        ("subagent_turns", 0),
    ],
)
def test_bad_spec_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        generate_workload(SPEC.replace(**{field: value}), 0)


def test_replace_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown"):
        SPEC.replace(sesions=3)


def test_latency_and_retry_knobs_keep_the_sessions():
    base = SPEC.replace(tool_tail_prob=0.0, retry_prob=0.0)
    stormy = generate_workload(base.replace(tool_tail_prob=0.5, retry_prob=0.5), 9)
    calm = generate_workload(base, 9)
    assert [(s.system_prompt, s.task, [t.tool_result for t in s.turns]) for s in stormy.sessions] == [
        (s.system_prompt, s.task, [t.tool_result for t in s.turns]) for s in calm.sessions
    ]
    assert [t.tool_latency_s for s in stormy.sessions for t in s.turns] != [
        t.tool_latency_s for s in calm.sessions for t in s.turns
    ]


def test_a_trace_renders_one_word_per_token_and_its_own_reply_lengths():
    from kvgate.bench.agentic.workload import workload_from_trace
    from kvgate.simulator.agent_trace import AgentTraceSpec, generate_trace

    trace = generate_trace(AgentTraceSpec(sessions=5, agents=2, token_scale=8), 7)
    workload = workload_from_trace(trace)
    assert workload == workload_from_trace(trace)  # deterministic
    assert workload.spec.concurrency == 2 and workload.spec.send_finish is False
    assert len({s.system_prompt for s in workload.sessions}) == 1  # shared by every session
    for plan, session in zip(workload.sessions, trace.sessions):
        assert len(plan.system_prompt.split()) == trace.system_prompt_tokens
        assert [t.reply_tokens for t in plan.turns] == [t.output_tokens for t in session.turns]
        assert [workload.reply_tokens(t) for t in plan.turns] == [t.output_tokens for t in session.turns]
        assert [len(t.tool_result.split()) for t in plan.turns[:-1]] == [
            t.tool_result_tokens for t in session.turns[:-1]
        ]
        assert [t.tool_latency_s for t in plan.turns] == [t.tool_time_s for t in session.turns]


def test_subagents_run_at_some_tool_calls_under_the_session_id_and_keep_the_main_threads():
    base = SPEC.replace(turns_min=5, turns_max=8)
    plain = generate_workload(base, 3)
    workload = generate_workload(base.replace(subagent_prob=0.5, subagent_turns=2), 3)
    subagents = [sub for session in workload.sessions for sub in session.subagents]
    assert subagents
    assert workload.num_turns == plain.num_turns + 2 * len(subagents)
    for session, alone in zip(workload.sessions, plain.sessions):
        # the main thread's text is the same with subagents or without
        assert (session.system_prompt, session.task) == (alone.system_prompt, alone.task)
        assert [t.tool_result for t in session.turns] == [t.tool_result for t in alone.turns]
        assert session.threads == (session, *(plan for _, plan in session.subagents))
        for after, sub in session.subagents:
            assert 1 <= after < len(session.turns)  # never after the last turn
            assert session.subagent_after(after) is sub
            assert session.turns[after - 1].tool_latency_s == 0  # its run is the tool call's time
            assert sub.session_id == session.session_id and sub.index == session.index
            assert sub.system_prompt != session.system_prompt and sub.task != session.task
            assert [t.index for t in sub.turns] == [1, 2] and sub.turns[-1].tool_result is None
        calls = {after for after, _ in session.subagents}
        assert [t.tool_latency_s for t in session.turns if t.index not in calls] == [
            t.tool_latency_s for t in alone.turns if t.index not in calls
        ]
    assert generate_workload(base.replace(subagent_prob=0.5, subagent_turns=2), 3) == workload
