"""The benchmark's three client APIs send one conversation and read their own streams."""

import orjson
import pytest

from kvgate.bench.agentic.apis import StreamState, turn_request
from kvgate.bench.agentic.workload import WorkloadSpec, build_messages, generate_workload

SPEC = WorkloadSpec(
    sessions=1,
    concurrency=1,
    turns_min=3,
    turns_max=3,
    system_prompt_words=5,
    task_words=5,
    tool_result_words_min=3,
    tool_result_words_max=5,
    reply_tokens=3,
)
SESSION = generate_workload(SPEC, 0).sessions[0]
REPLIES = [" one", " two"]


def test_chat_sends_the_history_and_the_session_header():
    body, headers = turn_request("chat", "m", SESSION, 3, REPLIES, 3, None)
    assert body["messages"] == build_messages(SESSION, REPLIES, 3) and body["max_tokens"] == 3
    assert headers == {"x-session-id": SESSION.session_id}


def test_a_capped_workloads_chat_turn_sends_the_cap_and_its_reply_as_min_tokens():
    body, _ = turn_request("chat", "m", SESSION, 3, REPLIES, 3, None, max_tokens=1024)
    assert (body["max_tokens"], body["min_tokens"]) == (1024, 3)
    with pytest.raises(ValueError, match="chat api only"):
        turn_request("messages", "m", SESSION, 3, REPLIES, 3, None, max_tokens=1024)


def test_a_capped_turn_with_stop_strings_is_sampled():
    """Where a random-weight vLLM model's text ends (`vllm-prefill-capped`): the stop strings
    after min_tokens, its text sampled, without a seed (vLLM 0.32 on CPU dies on one)."""
    body, _ = turn_request("chat", "m", SESSION, 3, REPLIES, 3, None, max_tokens=512, stop=(" ", "e"))
    assert (body["max_tokens"], body["min_tokens"], body["stop"], body["temperature"]) == (512, 3, [" ", "e"], 1.0)
    assert "seed" not in body
    plain, _ = turn_request("chat", "m", SESSION, 3, REPLIES, 3, None, max_tokens=512)
    assert "stop" not in plain and plain["temperature"] == 0.0
    with pytest.raises(ValueError, match="max_tokens"):
        turn_request("chat", "m", SESSION, 3, REPLIES, 3, None, stop=(" ",))
    with pytest.raises(ValueError, match="stop"):
        SPEC.replace(stop=(" ",)).validate()  # stop strings without a cap


def test_messages_sends_the_same_conversation_as_claude_code():
    body, headers = turn_request("messages", "m", SESSION, 3, REPLIES, 3, None)
    chat = build_messages(SESSION, REPLIES, 3)
    assert body["system"] == chat[0]["content"] and body["messages"] == chat[1:]
    assert orjson.loads(body["metadata"]["user_id"]) == {"session_id": SESSION.session_id}
    assert headers == {} and body["max_tokens"] == 3


def test_responses_chain_sends_only_the_new_input():
    first, headers = turn_request("responses", "m", SESSION, 1, [], 3, None)
    assert first["instructions"] == SESSION.system_prompt and "previous_response_id" not in first
    assert first["input"] == [{"role": "user", "content": SESSION.task}]
    third, _ = turn_request("responses", "m", SESSION, 3, REPLIES, 3, "resp_2")
    assert third["previous_response_id"] == "resp_2" and third["max_output_tokens"] == 3
    assert third["input"] == build_messages(SESSION, REPLIES, 3)[-1:]
    assert headers == {} and third["prompt_cache_key"] == SESSION.session_id
    with pytest.raises(ValueError):
        turn_request("responses", "m", SESSION, 2, REPLIES[:1], 3, None)


def feed(api, events):
    state = StreamState(api)
    firsts = [state.on_event(event) for event in events]
    return state, firsts


def test_messages_stream():
    state, firsts = feed(
        "messages",
        [
            {"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 40}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": " a"}},
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": " b"}},
            {"type": "message_delta", "usage": {"output_tokens": 2, "cache_read_input_tokens": 32}},
        ],
    )
    assert firsts == [False, False, True, False, False]
    assert (state.text, state.prompt_tokens, state.cached_tokens, state.error) == (" a b", 40, 32, None)


def test_responses_stream():
    state, firsts = feed(
        "responses",
        [
            {"type": "response.created", "response": {"id": "resp_9"}},
            {"type": "response.output_text.delta", "delta": " x"},
            {"type": "response.output_text.delta", "delta": " y"},
            {
                "type": "response.completed",
                "response": {
                    "id": "resp_9",
                    "usage": {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 48}},
                },
            },
        ],
    )
    assert firsts == [False, True, False, False]
    assert (state.text, state.response_id, state.prompt_tokens, state.cached_tokens) == (" x y", "resp_9", 50, 48)


def test_messages_stream_counts_the_cache_reads_and_writes_in_the_prompt():
    """vLLM with --enable-prompt-tokens-details: message_start has the whole prompt in
    input_tokens, message_delta the tokens it did not read from nor write to the cache."""
    usage = {"input_tokens": 8, "output_tokens": 2, "cache_creation_input_tokens": 16, "cache_read_input_tokens": 96}
    state, _ = feed(
        "messages",
        [
            {"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 120}}},
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": " a"}},
            {"type": "message_delta", "usage": usage},
        ],
    )
    assert (state.prompt_tokens, state.cached_tokens) == (120, 96)
    state, _ = feed(
        "messages",
        [
            {"type": "message_start", "message": {"usage": {"input_tokens": 120}}},
            {"type": "message_delta", "usage": {**usage, "cache_creation_input_tokens": None}},
        ],
    )
    assert (state.prompt_tokens, state.cached_tokens) == (104, 96)  # a server that reports no cache writes


@pytest.mark.parametrize(
    "api, event",
    [
        ("chat", {"error": {"message": "broken", "code": "upstream_stream_broken"}}),
        ("messages", {"type": "error", "error": {"type": "overloaded_error", "message": "x"}}),
        ("responses", {"type": "error", "code": "503", "message": "aborted"}),
    ],
)
def test_errors_in_any_stream(api, event):
    state, firsts = feed(api, [event])
    assert state.error == event and firsts == [False]
