"""The gate refuses a prompt its body proves longer than the replica serves, before probing
(`gate.request_body`): the bound's table, its soundness on multi-byte text, and the shell
in each gate mode."""

from __future__ import annotations

import math
import unicodedata

import pytest

from kvgate.gate.errors import PromptTooLong
from kvgate.gate.gate import Gate
from kvgate.gate.policies.vocabulary import RejectCode
from kvgate.gate.request_body import MAX_TEXT_SHRINK, over_long, prompt_token_floor, user_text_bytes
from kvgate.simulator.tokenizer import MAX_TOKEN_BYTES, render_chat, render_completion_prompt
from tests.gate.helpers import FakeProbe, assert_clean, body, sample, settings


def user(content: object) -> dict:
    return {"role": "user", "content": content}


@pytest.mark.parametrize(
    "route_kind, request_body, kept",
    [
        ("chat", {"messages": [user("hello")]}, 5),
        ("chat", {"messages": [user("  hello \n")]}, 5),  # a template may trim the content
        ("chat", {"messages": [user("héllo")]}, 6),  # UTF-8 bytes, not characters
        ("chat", {"messages": [user("日本語")]}, 9),
        ("chat", {"messages": [user("😀")]}, 4),
        ("chat", {"messages": [{"role": "system", "content": "x" * 50}, user("hi")]}, 2),  # a template may drop it
        ("chat", {"messages": [{"role": "assistant", "content": "x" * 50}, user("hi")]}, 2),  # ... or rewrite it
        ("chat", {"messages": [user("ab"), {"role": "assistant", "content": "c"}, user("de")]}, 4),
        ("chat", {"messages": [user([{"type": "text", "text": " ab "}, {"type": "image_url", "image_url": "x"}])]}, 2),
        ("chat", {"messages": [user([{"type": "text", "text": 7}, "loose string"])]}, 0),  # not text parts
        ("chat", {"messages": [user("x" * 100)], "truncate_prompt_tokens": 10}, 0),  # the server may cut it
        ("chat", {"messages": [user("x" * 100)], "chat_template": "{{ '' }}"}, 0),  # ... or render it its way
        ("chat", {"messages": "not a list"}, 0),
        ("chat", {}, 0),
        ("completion", {"prompt": " once upon "}, 9),
        ("completion", {"prompt": ["one prompt"]}, 10),
        ("completion", {"prompt": ["a batch", "of two"]}, 0),
        ("completion", {"prompt": [1, 2, 3]}, 0),  # token ids: their count is the server's check
        ("completion", {"prompt": "x" * 100, "truncate_prompt_tokens": 5}, 0),
        ("messages", {"system": "x" * 50, "messages": [user("hey"), user([{"type": "text", "text": "you"}])]}, 6),
        ("messages", {"messages": [user([{"type": "tool_result", "content": "x" * 50}])]}, 0),
        ("responses", {"input": "question"}, 8),
        ("responses", {"input": "question", "previous_response_id": "resp_1"}, 8),  # the history only adds
        (
            "responses",
            {
                "input": [
                    user([{"type": "input_text", "text": "q1"}]),
                    {"type": "message", "role": "user", "content": "q2"},
                ]
            },
            4,
        ),
        ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "x" * 50}]}, 0),
        ("responses", {"input": "question", "truncation": "auto"}, 0),
        ("responses", {"input": "question", "truncation": "disabled"}, 8),
    ],
)
def test_the_text_every_rendering_keeps(route_kind, request_body, kept):
    assert user_text_bytes(route_kind, request_body) == kept


@pytest.mark.parametrize(
    "text",
    [
        "plain english words in a sentence, " * 40,
        "日本語のテキストは一文字が三バイトです。" * 30,
        "emoji 😀🎉🚀 and more 😀😀😀😀😀😀😀😀 " * 30,
        "𠀀𠀁𠀂𠀃𠀄𠀅𠀆𠀇𠀈𠀉𠀊𠀋𠀌𠀍𠀎𠀏 " * 20,  # four-byte word characters: the longest word tokens
        "\u3000" * 500 + "x",  # three-byte whitespace runs
        " " * 5000 + "end",
        "e\u0301" * 300,  # combining marks
    ],
)
def test_the_floor_is_a_lower_bound_on_the_simulated_replicas_tokens(text):
    """Rendered by the simulated replica's own template and tokenizer (which report
    MAX_TOKEN_BYTES), every prompt has at least the floor's tokens, whatever the script."""
    for route_kind, request_body, tokens in (
        ("chat", {"messages": [user(text)]}, len(render_chat({"messages": [user(text)]}))),
        ("completion", {"prompt": text}, len(render_completion_prompt(text))),
    ):
        assert prompt_token_floor(user_text_bytes(route_kind, request_body), MAX_TOKEN_BYTES) <= tokens


@pytest.mark.parametrize(
    "text",
    [
        "\u1100\u1161\u11a8" * 200,  # Hangul jamo: NFC composes three (9 bytes) into one syllable (3 bytes)
        "\u03c9\u0314\u0342\u0345" * 200,  # omega with three marks: 8 bytes compose into 3
        "u\u0308\u0304" * 200,  # u with two marks: 5 bytes compose into 2
        "ﾊﾟﾋﾟﾌﾟ" * 200,  # NFKC: half-width kana and sound marks compose
    ],
)
@pytest.mark.parametrize("max_token_bytes", [1, 4, 16, 128])
def test_the_floor_survives_a_normalizer_that_composes_characters(text, max_token_bytes):
    """A tokenizer may normalize text before splitting it: however it then splits the
    normalized text, it needs at least bytes / max_token_bytes tokens, never fewer than the floor."""
    for form in ("NFC", "NFKC"):
        normalized = unicodedata.normalize(form, text).encode("utf-8")
        fewest_tokens = math.ceil(len(normalized) / max_token_bytes)
        assert prompt_token_floor(len(text.encode("utf-8")), max_token_bytes) <= fewest_tokens, form


@pytest.mark.parametrize(
    "text_bytes, max_model_len, max_token_bytes, refused",
    [
        (0, 4096, 48, False),
        (4096 * 48 * MAX_TEXT_SHRINK, 4096, 48, False),  # exactly max_model_len tokens at the floor
        (4096 * 48 * MAX_TEXT_SHRINK + 1, 4096, 48, True),
        (14_000_000, 4096, 48, True),
        (14_000_000, None, 48, False),  # a replica that does not say: no floor
        (14_000_000, 4096, None, False),
        (14_000_000, 100_000, 48, False),
    ],
)
def test_over_long_refuses_only_above_max_model_len(text_bytes, max_model_len, max_token_bytes, refused):
    refusal = over_long(text_bytes, max_model_len, max_token_bytes)
    assert (refusal is not None) == refused
    if refusal is not None:
        assert refusal.code == RejectCode.PROMPT_TOO_LONG and f"max_model_len ({max_model_len})" in refusal.message


# ------------------------------------------------------------------------------ the shell

HUGE = "word " * 200_000  # 1 MB of user text: at least 6,945 tokens at 48 bytes a token


def replica_probe() -> FakeProbe:
    return FakeProbe(usage=0.1, total=100, free=100, block_size=16, max_model_len=4096, max_token_bytes=48)


@pytest.mark.parametrize("policy", ["working_set", "watermark"])
@pytest.mark.parametrize("session", ["s1", None])
async def test_enforce_refuses_an_over_long_body_without_probing(policy, session, metrics, clock):
    """The first turn of a session, a later one and an anonymous one: 400 before any probe."""
    probe = replica_probe()
    gate = Gate("r0", probe, settings(policy=policy), metrics, clock)
    if session is not None:
        (await gate.acquire(session, "chat", body(session, "short"))).release()
    calls = list(probe.prefix_calls)
    for _ in range(2):
        with pytest.raises(PromptTooLong, match="max_model_len"):
            await gate.acquire(session, "chat", body(session or "anon", HUGE))
    assert probe.prefix_calls == calls
    assert gate.counts()["windows"] == 0  # the refusal took the session's window back
    assert_clean(gate, clock)


async def test_a_body_that_fits_is_decided_as_before(metrics, clock):
    probe = replica_probe()
    probe.max_model_len = 1_000_000
    gate = Gate("r0", probe, settings(policy="working_set"), metrics, clock)
    lease = await gate.acquire("s1", "chat", body("s1", HUGE))
    assert lease.reason != "prompt_too_long"
    lease.release()
    assert_clean(gate, clock)


async def test_shadow_records_the_refusal_unprobed_and_lets_it_through(metrics, clock):
    probe = replica_probe()
    gate = Gate("r0", probe, settings(mode="shadow", policy="working_set"), metrics, clock)
    lease = await gate.acquire("s1", "chat", body("s1", HUGE))
    assert lease.reason == "shadow_prompt_too_long" and probe.prefix_calls == []
    lease.release()
    assert sample(metrics, "kvgate_admissions_total", replica="r0", reason="shadow_prompt_too_long") == 1
    assert_clean(gate, clock)


async def test_off_checks_nothing(metrics, clock):
    probe = replica_probe()
    gate = Gate("r0", probe, settings(mode="off"), metrics, clock)
    lease = await gate.acquire("s1", "chat", body("s1", HUGE))
    assert lease.reason == "open" and probe.usage_calls == 0
    lease.release()
    assert_clean(gate, clock)
