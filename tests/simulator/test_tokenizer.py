"""The built-in tokenizer is deterministic across processes and the chat template is prefix-stable."""

import os
import subprocess
import sys

import pytest

from kvgate.simulator.tokenizer import (
    BOS,
    OUTPUT_IDS,
    TemplateError,
    decode_token,
    encode,
    output_token,
    render_chat,
    render_completion_prompt,
)

TEXT = "Read the file src/main.py, then run `pytest -q` and fix the failing test."


def test_same_ids_in_another_process_with_another_hash_seed():
    code = f"from simulator.tokenizer import encode; print(encode({TEXT!r}))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(encode(TEXT))


def test_text_prefix_gives_token_prefix_at_word_boundaries():
    words = TEXT.split(" ")
    head = " ".join(words[:5])
    assert encode(TEXT)[: len(encode(head))] == encode(head)
    assert len(encode(TEXT)) >= len(words)


def test_conversation_growth_keeps_earlier_rendering_as_exact_prefix():
    turn1 = {
        "messages": [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": TEXT}],
        "tools": [{"type": "function", "function": {"name": "run", "parameters": {}}}],
    }
    turn2 = {
        "messages": turn1["messages"]
        + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "1 failed, 9 passed"},
        ],
        "tools": turn1["tools"],
    }
    first, second = render_chat(turn1), render_chat(turn2)
    assert first[0] == BOS
    # The first turn's generation prompt is where the assistant's answer starts in turn 2.
    assert second[: len(first)] == first


def test_generated_tokens_decode_to_words_that_reencode_to_the_same_ids():
    ids = [output_token(position) for position in range(20)]
    assert set(ids) <= set(OUTPUT_IDS)
    text = "".join(decode_token(t) for t in ids)
    assert encode(text) == ids


def test_content_parts_and_unknown_roles_render():
    parts = render_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
                },
                {"role": "critic", "content": "ok"},
            ]
        }
    )
    assert len(parts) > 4


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, message):
    with pytest.raises(TemplateError, match=message):
        render_chat(body)


def test_completion_prompts():
    assert render_completion_prompt("hello world") == [BOS, *encode("hello world")]
    assert render_completion_prompt([5, 6, 7]) == [5, 6, 7]
    assert render_completion_prompt(["hi"]) == render_completion_prompt("hi")
    for bad in (["a", "b"], [], 3, [1, -1]):
        with pytest.raises(TemplateError):
            render_completion_prompt(bad)
