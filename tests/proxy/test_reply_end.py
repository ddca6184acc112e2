"""How a reply ended (proxy.reply_end) and the usage tap that reads it off an answer as it
passes: each API's JSON answer and stream, a stream cut at every byte, and the requests
whose reply can end an agent's run."""

from __future__ import annotations

import orjson
import pytest

from kvgate.proxy.reply_end import ReplyEnd, ends_agent_run, leaves_tools_to_model, reply_end_of, stream_chat_end
from kvgate.proxy.usage_tap import PromptUsage, UsageTap

TOOL = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
USAGE = {"prompt_tokens": 30, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 16}}


def chat_answer(reason: str | None, tool_calls: list | None = None) -> dict:
    message = {"role": "assistant", "content": None if tool_calls else "done", "tool_calls": tool_calls or []}
    return {"object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": reason}]}


@pytest.mark.parametrize(
    "doc, kind, end",
    [
        (chat_answer("stop"), "chat", ReplyEnd.FINAL),
        (chat_answer("tool_calls"), "chat", ReplyEnd.TOOL_CALL),
        (chat_answer("length"), "chat", ReplyEnd.CUT),
        (chat_answer(None), "chat", ReplyEnd.UNKNOWN),
        # vLLM answers a forced call with finish_reason stop: the message's calls say it
        (
            chat_answer("stop", [{"id": "c", "type": "function", "function": {"name": "read"}}]),
            "chat",
            ReplyEnd.TOOL_CALL,
        ),
        (
            {"choices": [{"finish_reason": "stop"}, {"finish_reason": "tool_calls"}]},
            "chat",
            ReplyEnd.TOOL_CALL,
        ),  # any choice calling a tool
        ({"choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}]}, "chat", ReplyEnd.CUT),
        ({"choices": []}, "chat", ReplyEnd.UNKNOWN),
        ({"type": "message", "stop_reason": "end_turn"}, "messages", ReplyEnd.FINAL),
        ({"type": "message", "stop_reason": "stop_sequence"}, "messages", ReplyEnd.FINAL),
        ({"type": "message", "stop_reason": "tool_use"}, "messages", ReplyEnd.TOOL_CALL),
        ({"type": "message", "stop_reason": "max_tokens"}, "messages", ReplyEnd.CUT),
        ({"type": "message", "stop_reason": "pause_turn"}, "messages", ReplyEnd.CUT),
        ({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, "messages", ReplyEnd.FINAL),
        ({"type": "message_delta", "delta": {"stop_reason": "tool_use"}}, "messages", ReplyEnd.TOOL_CALL),
        ({"object": "response", "status": "completed", "output": [{"type": "message"}]}, "responses", ReplyEnd.FINAL),
        (
            {"object": "response", "status": "completed", "output": [{"type": "function_call"}]},
            "responses",
            ReplyEnd.TOOL_CALL,
        ),
        ({"object": "response", "status": "incomplete", "output": [{"type": "message"}]}, "responses", ReplyEnd.CUT),
        (
            {"type": "response.completed", "response": {"status": "completed", "output": [{"type": "message"}]}},
            "responses",
            ReplyEnd.FINAL,
        ),
        ({"type": "response.completed", "response": {"status": "completed"}}, "responses", ReplyEnd.UNKNOWN),
        ("not an object", "chat", ReplyEnd.UNKNOWN),
    ],
)
def test_reply_end_of_each_api(doc, kind, end):
    assert reply_end_of(doc, kind) is end


@pytest.mark.parametrize(
    "body, leaves",
    [
        ({"tools": [TOOL]}, True),
        ({"tools": [TOOL], "tool_choice": "auto"}, True),
        ({"tools": [TOOL], "tool_choice": {"type": "auto"}}, True),  # Anthropic's
        ({"tools": [TOOL], "tool_choice": "none"}, False),
        ({"tools": [TOOL], "tool_choice": {"type": "none"}}, False),
        ({"tools": [TOOL], "tool_choice": "required"}, False),  # forced: a call, whatever the finish reason
        ({"tools": [TOOL], "tool_choice": {"type": "any"}}, False),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "read"}}}, False),
        ({"tools": []}, False),
        ({}, False),
        ({"tools": "read"}, False),
    ],
)
def test_only_a_model_free_to_call_a_tool_can_end_a_run(body, leaves):
    assert leaves_tools_to_model(body) is leaves
    assert ends_agent_run(body, ReplyEnd.FINAL) is leaves
    assert not ends_agent_run(body, ReplyEnd.TOOL_CALL) and not ends_agent_run(body, ReplyEnd.CUT)


def sse(doc: dict | str) -> bytes:
    return b"data: " + (doc.encode() if isinstance(doc, str) else orjson.dumps(doc)) + b"\n\n"


def chat_stream(reason: str) -> bytes:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}}]}
    content = [{**chunk, "choices": [{**chunk["choices"][0], "finish_reason": None}]} for _ in range(3)]
    last = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
    usage = {"object": "chat.completion.chunk", "choices": [], "usage": USAGE}
    return b"".join(sse(doc) for doc in [*content, last, usage]) + sse("[DONE]")


def messages_stream(reason: str) -> bytes:
    delta = {"type": "message_delta", "delta": {"stop_reason": reason}, "usage": {"input_tokens": 30}}
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 30}}}
    return b"".join(sse(doc) for doc in [start, {"type": "content_block_delta"}, delta, {"type": "message_stop"}])


def responses_stream(output_type: str) -> bytes:
    response = {"status": "completed", "output": [{"type": output_type}], "usage": {"input_tokens": 30}}
    return sse({"type": "response.created", "response": {"usage": None}}) + sse(
        {"type": "response.completed", "response": response}
    )


def tapped(data: bytes, kind: str, strip: bool, cut: int) -> tuple[bytes, UsageTap]:
    """`data` through a tap that reads the end, in pieces of `cut` bytes."""
    tap = UsageTap(strip, kind, read_end=True)
    out = b"".join(tap.feed(data[at : at + cut]) for at in range(0, len(data), cut)) + tap.finish()
    return out, tap


@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("reason, end", [("stop", ReplyEnd.FINAL), ("tool_calls", ReplyEnd.TOOL_CALL)])
def test_a_chat_streams_end_is_read_in_pieces_of_any_size(strip, reason, end):
    data = chat_stream(reason)
    for cut in range(1, len(data) + 1, 7):
        out, tap = tapped(data, "chat", strip, cut)
        assert tap.end is end and tap.usage == PromptUsage(30, 16, 4)
        assert out == (
            data
            if not strip
            else data.replace(sse({"object": "chat.completion.chunk", "choices": [], "usage": USAGE}), b"")
        )


@pytest.mark.parametrize(
    "data, kind, end",
    [
        (messages_stream("end_turn"), "messages", ReplyEnd.FINAL),
        (messages_stream("tool_use"), "messages", ReplyEnd.TOOL_CALL),
        (messages_stream("max_tokens"), "messages", ReplyEnd.CUT),
        (responses_stream("message"), "responses", ReplyEnd.FINAL),
        (responses_stream("function_call"), "responses", ReplyEnd.TOOL_CALL),
    ],
)
def test_an_anthropic_or_responses_streams_end_is_read_off_its_usage_event(data, kind, end):
    for cut in (1, 5, len(data)):
        out, tap = tapped(data, kind, False, cut)
        assert out == data and tap.end is end and tap.usage is not None


def test_a_json_answers_end_and_usage_are_read_in_one_parse():
    tap = UsageTap(False, "chat", read_end=True)
    tap.whole(orjson.dumps({**chat_answer("stop"), "usage": USAGE}))
    assert (tap.end, tap.usage) == (ReplyEnd.FINAL, PromptUsage(30, 16, 4))
    tap = UsageTap(False, "chat", read_end=True)
    tap.whole(b"{not json")
    assert (tap.end, tap.usage) == (ReplyEnd.UNKNOWN, None)


def test_without_read_end_the_tap_reads_no_end():
    for data, kind in ((chat_stream("stop"), "chat"), (messages_stream("end_turn"), "messages")):
        tap = UsageTap(False, kind)
        tap.feed(data)
        tap.finish()
        assert tap.end is ReplyEnd.UNKNOWN and tap.usage is not None
    tap = UsageTap(False, "chat")
    tap.whole(orjson.dumps({**chat_answer("stop"), "usage": USAGE}))
    assert tap.end is ReplyEnd.UNKNOWN


def test_stream_chat_end_reads_the_finish_reasons_that_are_not_null():
    assert stream_chat_end(b'{"finish_reason":null}') is None
    assert stream_chat_end(b'{"finish_reason": "stop"}') is ReplyEnd.FINAL
    assert stream_chat_end(b'{"finish_reason":"stop"}{"finish_reason":"tool_calls"}') is ReplyEnd.TOOL_CALL
