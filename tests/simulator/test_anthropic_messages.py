"""POST /v1/messages (Anthropic Messages API, as vLLM serves it) on the simulated replica."""

import orjson
import pytest

from kvgate.simulator.config import EngineConfig
from kvgate.simulator.replica_server import build_replica_app
from kvgate.simulator.reply_model import FIXED_LENGTHS

BODY = {
    "model": "claude-any",
    "max_tokens": 4,
    "system": "You are a coding agent.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "fix the failing test " * 10}]}],
    "tools": [{"name": "bash", "input_schema": {"type": "object"}}],
}


def prompt_of(usage: dict) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


async def test_message_non_streaming_and_prefix_reuse_across_turns(replica_client):
    client = await replica_client()
    first = await (await client.post("/v1/messages", json=BODY)).json()
    assert first["type"] == "message" and first["role"] == "assistant" and first["model"] == "claude-any"
    assert first["stop_reason"] == "max_tokens" and len(first["content"][0]["text"].split()) == 4
    # as vLLM with --enable-prompt-tokens-details: input_tokens leaves out the cache reads and writes
    assert first["usage"]["output_tokens"] == 4 and prompt_of(first["usage"]) > 20
    assert first["usage"]["cache_read_input_tokens"] == 0
    assert first["usage"]["cache_creation_input_tokens"] == prompt_of(first["usage"]) // 16 * 16
    turn2 = BODY | {
        "messages": BODY["messages"]
        + [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "pytest"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1 failed"}]},
        ]
    }
    second = await (await client.post("/v1/messages", json=turn2)).json()
    # The first turn's prompt is an exact prefix of the second's: its full blocks hit,
    # and the second writes its own full blocks beyond them.
    first_blocks, second_blocks = prompt_of(first["usage"]) // 16 * 16, prompt_of(second["usage"]) // 16 * 16
    assert second["usage"]["cache_read_input_tokens"] == first_blocks
    assert second["usage"]["cache_creation_input_tokens"] == second_blocks - first_blocks > 0


async def test_message_streaming_event_sequence(replica_client):
    client = await replica_client()
    response = await client.post("/v1/messages", json=BODY | {"stream": True})
    assert response.status == 200
    raw = (await response.read()).decode()
    events = [block.split("\n") for block in raw.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * 4 + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = [orjson.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"]["output_tokens"] == 4
    # message_start has the whole prompt in input_tokens; message_delta the usage in parts, as vLLM's
    assert prompt_of(data[-2]["usage"]) == data[0]["message"]["usage"]["input_tokens"] > 20
    text = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    assert len(text.split()) == 4


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 3, "messages": []}, "messages"),
        ({"max_tokens": 3, "messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"max_tokens": 3, "messages": [{"role": "user", "content": "hi " * 1100}]}, "too long"),
    ],
)
async def test_message_errors_are_anthropic_shaped(replica_client, body, needle):
    client = await replica_client(num_blocks=64, block_size=16)
    response = await client.post("/v1/messages", json=body)
    assert response.status == 400
    error = await response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]


CLAUDE_CODE_BODY = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 128000,
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "read README.md and summarise it"}]},
        {"role": "system", "content": "<system-reminder>the working directory is /tmp/task</system-reminder>"},
    ],
    "tools": [{"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}],
    "thinking": {"type": "enabled", "budget_tokens": 31999},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "medium"},
    "metadata": {"user_id": "user_abc_account__session_0b6e"},
    "stream": True,
}


async def test_what_claude_code_sends_is_served(replica_client):
    """A `role: "system"` entry inside `messages`, `thinking`, `context_management`,
    `output_config` and max_tokens 128,000 (beyond the context: a cap) are served, not a 400."""
    client = await replica_client(num_blocks=512, block_size=16)  # 8,192 tokens of context
    response = await client.post("/v1/messages", json=CLAUDE_CODE_BODY)
    assert response.status == 200, await response.text()
    events = [
        orjson.loads(line.removeprefix("data: "))
        for line in (await response.text()).split("\n")
        if line.startswith("data: ")
    ]
    stop = next(event for event in events if event["type"] == "message_delta")
    assert stop["delta"]["stop_reason"] in ("end_turn", "tool_use")
    assert 0 < stop["usage"]["output_tokens"] < 8192
    plain = await client.post("/v1/messages", json=CLAUDE_CODE_BODY | {"stream": False})
    assert plain.status == 200 and (await plain.json())["stop_reason"] in ("end_turn", "tool_use")
    counted = await client.post("/v1/messages/count_tokens", json=CLAUDE_CODE_BODY)
    assert counted.status == 200 and (await counted.json())["input_tokens"] > 20


async def test_max_tokens_beyond_the_context_is_lowered_to_the_context_left(aiohttp_client):
    """With exact-length replies, max_tokens 128,000 on a 1,024-token context generates
    exactly what is left after the prompt and stops at max_tokens."""
    app = build_replica_app(EngineConfig(num_blocks=64, block_size=16), time_scale=0.0, reply_model=FIXED_LENGTHS)
    client = await aiohttp_client(app)
    response = await client.post("/v1/messages", json=CLAUDE_CODE_BODY | {"stream": False})
    assert response.status == 200, await response.text()
    answer = await response.json()
    assert answer["stop_reason"] == "max_tokens"
    assert prompt_of(answer["usage"]) + answer["usage"]["output_tokens"] == 1024
