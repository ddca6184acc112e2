"""proxy.usage_tap: a turn's usage read off its answer; the usage event kvgate asked for taken out."""

from __future__ import annotations

import orjson
import pytest

from kvgate.proxy import usage_tap
from kvgate.proxy.usage_tap import PromptUsage, UsageTap, asks_for_usage, json_usage, usage_of


def sse(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


CHUNKS = [
    sse({"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}),
    sse(
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    ),
]
USAGE_EVENT = sse(
    {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 120, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 96}},
    }
)
DONE = b"data: [DONE]\n\n"
STREAM = b"".join(CHUNKS) + USAGE_EVENT + DONE


def relay(tap: UsageTap, pieces: list[bytes]) -> bytes:
    return b"".join(tap.feed(piece) for piece in pieces) + tap.finish()


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_stripping_removes_exactly_the_usage_event_however_the_stream_is_cut(cut):
    tap = UsageTap(strip=True)
    assert relay(tap, [STREAM[:cut], STREAM[cut:]]) == b"".join(CHUNKS) + DONE
    assert tap.usage == PromptUsage(120, 96, 2)


def test_stripping_passes_whole_events_on_at_once():
    tap = UsageTap(strip=True)
    assert tap.feed(CHUNKS[0]) == CHUNKS[0]  # nothing held back: vLLM writes whole events
    assert tap.feed(CHUNKS[1][:10]) == b""  # the start of an event waits for its end
    assert tap.feed(CHUNKS[1][10:]) == CHUNKS[1]


def test_without_stripping_every_chunk_passes_as_it_came():
    tap = UsageTap(strip=False)
    pieces = [STREAM[i : i + 7] for i in range(0, len(STREAM), 7)]
    assert [tap.feed(piece) for piece in pieces] == pieces
    assert tap.finish() == b"" and tap.usage == PromptUsage(120, 96, 2)


def test_a_stream_without_a_usage_event_has_no_usage_and_is_untouched():
    stream = b"".join(CHUNKS) + DONE
    for strip in (True, False):
        tap = UsageTap(strip=strip)
        assert relay(tap, [stream]) == stream and tap.usage is None


def test_a_content_chunk_that_mentions_usage_is_kept():
    chunk = sse({"id": "c", "choices": [{"index": 0, "delta": {"content": '"usage": {"prompt_tokens": 5}'}}]})
    tap = UsageTap(strip=True)
    assert relay(tap, [chunk + DONE]) == chunk + DONE and tap.usage is None


@pytest.mark.parametrize(
    "doc, expected",
    [
        ({"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}}, PromptUsage(10, 4)),
        ({"usage": {"prompt_tokens": 10}}, PromptUsage(10, None)),  # a server without prompt_tokens_details
        ({"usage": {"prompt_tokens": 10, "prompt_tokens_details": None}}, PromptUsage(10, None)),
        ({"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}}}, PromptUsage(10, None)),
        ({"usage": {"prompt_tokens": 10, "completion_tokens": 7}}, PromptUsage(10, None, 7)),  # the reply's length
        ({"usage": {"prompt_tokens": 10, "completion_tokens": -1}}, PromptUsage(10, None)),  # not a count: unknown
        ({"usage": {"prompt_tokens": 10, "completion_tokens": "7"}}, PromptUsage(10, None)),
        ({"usage": {"prompt_tokens": 0}}, None),
        ({"usage": {"prompt_tokens": True}}, None),
        ({"usage": None}, None),
        ([], None),
    ],
)
def test_usage_of(doc, expected):
    assert usage_of(doc) == expected


def test_json_usage():
    assert json_usage(orjson.dumps({"choices": [], "usage": {"prompt_tokens": 7}})) == PromptUsage(7, None)
    assert json_usage(b'{"usage": ') is None and json_usage(b"{}") is None


@pytest.mark.parametrize(
    "body, asks",
    [
        ({"stream": True}, True),
        ({"stream": True, "stream_options": {"include_usage": True}}, False),  # the client asked itself
        ({"stream": True, "stream_options": {"continuous_usage_stats": False}}, False),  # left as sent
        ({"stream": False}, False),  # the JSON answer always has its usage
        ({}, False),
    ],
)
def test_asks_for_usage(body, asks):
    assert asks_for_usage(body) is asks


def test_a_server_that_sends_usage_unasked_keeps_its_usage_event():
    """vLLM with --enable-force-include-usage puts usage on every event and sends the usage
    event whatever the request asked: the client would get it without kvgate, so it stays."""
    content = sse({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": {"prompt_tokens": 120}})
    stream = content + USAGE_EVENT + DONE
    tap = UsageTap(strip=True)
    assert relay(tap, [stream]) == stream and tap.usage == PromptUsage(120, 96, 2)


def event(name: str, doc: object) -> bytes:
    return b"event: " + name.encode() + b"\n" + sse(doc)


# an Anthropic stream as vLLM sends it: message_start has the whole prompt in input_tokens,
# message_delta the usage in parts (with --enable-prompt-tokens-details)
MESSAGES_STREAM = b"".join(
    [
        event("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 120}}}),
        event("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}}),
        event(
            "message_delta",
            {
                "type": "message_delta",
                "usage": {
                    "input_tokens": 8,
                    "output_tokens": 2,
                    "cache_creation_input_tokens": 16,
                    "cache_read_input_tokens": 96,
                },
            },
        ),
        event("message_stop", {"type": "message_stop"}),
    ]
)


def responses_stream(text: str) -> bytes:
    """A Responses stream whose response.completed holds the output `text` (as vLLM's does)."""
    usage = {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 96}, "output_tokens": 2}
    return b"".join(
        [
            event("response.created", {"type": "response.created", "response": {"id": "r", "usage": None}}),
            event("response.output_text.delta", {"type": "response.output_text.delta", "delta": text}),
            event(
                "response.completed",
                {"type": "response.completed", "response": {"id": "r", "output": [text], "usage": usage}},
            ),
        ]
    )


@pytest.mark.parametrize(
    "kind, doc, expected",
    [
        ("messages", {"usage": {"input_tokens": 10}}, PromptUsage(10, None)),  # no prompt details
        (
            "messages",
            {"usage": {"input_tokens": 3, "cache_creation_input_tokens": 16, "cache_read_input_tokens": 32}},
            PromptUsage(51, 32),
        ),
        ("messages", {"usage": {"input_tokens": 3, "cache_read_input_tokens": None}}, PromptUsage(3, None)),
        ("messages", {"usage": {"input_tokens": 3, "output_tokens": 9}}, PromptUsage(3, None, 9)),
        ("messages", {"usage": {"input_tokens": 0, "cache_read_input_tokens": 16}}, PromptUsage(16, 16)),
        ("messages", {"usage": {"input_tokens": 3, "cache_read_input_tokens": "16"}}, None),
        ("messages", {"usage": {"input_tokens": 0}}, None),
        ("messages", {"usage": {"prompt_tokens": 10}}, None),
        ("messages", {"type": "message_start", "message": {"usage": {"input_tokens": 10}}}, None),
        (
            "responses",
            {"usage": {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 48}}},
            PromptUsage(50, 48),
        ),
        ("responses", {"usage": {"input_tokens": 50}}, PromptUsage(50, None)),
        ("responses", {"usage": {"input_tokens": 50, "output_tokens": 12}}, PromptUsage(50, None, 12)),
        (
            "responses",
            {"type": "response.completed", "response": {"usage": {"input_tokens": 50}}},
            PromptUsage(50, None),
        ),
        ("responses", {"type": "response.created", "response": {"usage": None}}, None),
        ("responses", {"usage": {"prompt_tokens": 10}}, None),
        ("chat", {"usage": {"input_tokens": 10}}, None),
    ],
)
def test_usage_of_each_api(kind, doc, expected):
    assert usage_of(doc, kind) == expected
    assert json_usage(orjson.dumps(doc), kind) == expected


@pytest.mark.parametrize("cut", range(1, len(MESSAGES_STREAM), 7))
def test_an_anthropic_stream_passes_as_it_came_and_its_message_delta_has_the_usage(cut):
    tap = UsageTap(strip=False, kind="messages")
    pieces = [MESSAGES_STREAM[:cut], MESSAGES_STREAM[cut:]]
    assert [tap.feed(piece) for piece in pieces] == pieces and tap.finish() == b""
    assert tap.usage == PromptUsage(120, 96, 2)


@pytest.mark.parametrize("size", [10, 100_000])
def test_a_responses_stream_has_its_usage_in_response_completed_however_long(size):
    """response.completed holds the whole response: far more than a chat stream's last bytes."""
    stream = responses_stream("x" * size)
    pieces = [stream[i : i + 4096] for i in range(0, len(stream), 4096)]
    tap = UsageTap(strip=False, kind="responses")
    assert [tap.feed(piece) for piece in pieces] == pieces and tap.finish() == b""
    assert tap.usage == PromptUsage(120, 96, 2)


def test_an_event_too_long_to_hold_is_not_held(monkeypatch):
    monkeypatch.setattr(usage_tap, "_EVENT_BYTES", 1000)
    stream = responses_stream("x" * 5000)
    tap = UsageTap(strip=False, kind="responses")
    assert tap.feed(stream[:3000]) == stream[:3000] and not tap._held
    assert tap.feed(stream[3000:]) == stream[3000:] and tap.finish() == b""
    assert tap.usage == PromptUsage(120, 96, 2)  # read from the stream's last bytes, as a chat stream's


def test_json_answers_of_each_api():
    message = {"type": "message", "usage": {"input_tokens": 5, "cache_read_input_tokens": 16}}
    response = {"object": "response", "usage": {"input_tokens": 21, "input_tokens_details": {"cached_tokens": 16}}}
    for kind, answer in (("messages", message), ("responses", response)):
        tap = UsageTap(strip=False, kind=kind)
        tap.whole(orjson.dumps(answer))
        assert tap.usage == PromptUsage(21, 16)


CRLF_STREAM = STREAM.replace(b"\n", b"\r\n")


@pytest.mark.parametrize("cut", range(1, len(CRLF_STREAM)))
def test_crlf_framed_events_pass_at_once_and_their_usage_event_is_stripped(cut):
    tap = UsageTap(strip=True)
    out = tap.feed(CRLF_STREAM[:cut]) + tap.feed(CRLF_STREAM[cut:]) + tap.finish()
    assert out == b"".join(CHUNKS).replace(b"\n", b"\r\n") + DONE.replace(b"\n", b"\r\n")
    assert tap.usage == PromptUsage(120, 96, 2)


def test_crlf_framed_events_are_passed_on_as_each_ends():
    tap = UsageTap(strip=True)
    for chunk in CHUNKS:
        assert tap.feed(chunk.replace(b"\n", b"\r\n")) == chunk.replace(b"\n", b"\r\n")


def test_an_event_too_long_to_hold_is_passed_on_unread_when_stripping(monkeypatch):
    monkeypatch.setattr(usage_tap, "_EVENT_BYTES", 1000)
    long_event = sse({"choices": [{"index": 0, "delta": {"content": "x" * 5000}}]})
    stream = long_event + STREAM
    tap = UsageTap(strip=True)
    out = []
    for i in range(0, len(stream), 300):
        out.append(tap.feed(stream[i : i + 300]))
        assert len(tap._held) <= 1000 + 300  # never more than the cap and one chunk
    assert b"".join(out) + tap.finish() == long_event + b"".join(CHUNKS) + DONE
    assert tap.usage == PromptUsage(120, 96, 2)  # the events after the long one are read again


@pytest.mark.parametrize("crlf", [False, True])
def test_the_events_after_an_over_long_one_are_read_however_the_stream_is_cut(monkeypatch, crlf):
    monkeypatch.setattr(usage_tap, "_EVENT_BYTES", 200)
    end = b"\r\n\r\n" if crlf else b"\n\n"
    long_event = sse({"choices": [{"index": 0, "delta": {"content": "x" * 250}}]}).replace(b"\n\n", end)
    stream = long_event + USAGE_EVENT.replace(b"\n\n", end) + DONE.replace(b"\n\n", end)
    for cut in range(1, len(stream)):
        tap = UsageTap(strip=True)
        out = tap.feed(stream[:cut]) + tap.feed(stream[cut:]) + tap.finish()
        assert out == long_event + DONE.replace(b"\n\n", end), cut
        assert tap.usage == PromptUsage(120, 96, 2), cut
