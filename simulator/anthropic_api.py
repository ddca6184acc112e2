"""Pure request parsing and response shaping for POST /v1/messages (Anthropic Messages
API, which vLLM also serves), so Anthropic clients can use the embedded default.

An Anthropic body is rendered through the same chat template as /v1/chat/completions:
`system` becomes a leading system message, and a `role: "system"` entry inside
`messages` (as Claude Code sends) a system message in its place; content blocks keep
their text, and other blocks (tool_use, tool_result, images) render as their sorted
JSON. A growing conversation therefore keeps its earlier rendering as an exact token
prefix. Fields the replica has no use for (`thinking`, `context_management`,
`output_config`, `metadata`, ...) are accepted and ignored, and `max_tokens` is a cap:
one beyond the context left is lowered to it, as clients ask for more than a model's
context (Claude Code: 128,000).
"""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.simulator.openai_api import ApiError, GenerationParams, _optional
from kvgate.simulator.reply_model import ToolCall, function_tools, tool_offer
from kvgate.simulator.tokenizer import TemplateError, render_chat
from kvgate.wire.errors import anthropic_error, anthropic_type

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
MESSAGE_ROLES = ("user", "assistant", "system")


def anthropic_error_body(error: ApiError) -> dict:
    return anthropic_error(error.message, anthropic_type(error.status))


def to_chat_body(body: dict) -> dict:
    """The /v1/chat/completions body the template renders for an Anthropic body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: must be a non-empty list of {role, content} objects", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in MESSAGE_ROLES:
            raise ApiError(f"messages.{index}.role: must be 'user', 'assistant' or 'system'", param="messages")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise ApiError("system: must be a string or a list of text blocks", param="system")
    chat_messages = ([{"role": "system", "content": system}] if system else []) + messages
    chat = {"messages": chat_messages}
    if body.get("tools") is not None:
        chat["tools"] = body["tools"]
    return chat


def render_messages(body) -> tuple[list[int], None]:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        return render_chat(to_chat_body(body)), None
    except TemplateError as error:
        raise ApiError(str(error)) from None


def parse_messages(body, served_model: str, max_model_len: int) -> GenerationParams:
    prompt_ids, _ = render_messages(body)
    model = _optional(body, "model", (str,), "a string") or served_model
    stream = _optional(body, "stream", (bool,), "a boolean") or False
    max_tokens = _optional(body, "max_tokens", (int,), "an integer")
    if max_tokens is None or max_tokens < 1:
        raise ApiError("max_tokens: must be an integer >= 1 (it is required)", param="max_tokens")
    prompt_len = len(prompt_ids)
    if prompt_len >= max_model_len:
        raise ApiError(
            f"prompt is too long: {prompt_len} tokens >= the maximum context length {max_model_len}. "
            "Reduce the conversation."
        )
    offer = tool_offer(function_tools(body.get("tools"), "messages"), body.get("tool_choice"))
    capped = min(max_tokens, max_model_len - prompt_len)
    return GenerationParams("messages", model, prompt_ids, capped, stream, True, None, offer=offer)


def message_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, block_size: int) -> dict:
    """A turn's usage as vLLM started with --enable-prompt-tokens-details reports it:
    `input_tokens` leaves out, as Anthropic's does, the prompt tokens read from the prefix
    cache (`cache_read_input_tokens`) and those the turn wrote to it, its full blocks
    beyond the hit (`cache_creation_input_tokens`). The three add up to the prompt."""
    created = max(0, prompt_tokens // block_size * block_size - cached_tokens)
    return {
        "input_tokens": prompt_tokens - cached_tokens - created,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached_tokens,
    }


def tool_use_block(call: ToolCall, with_input: bool = True) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.key, "name": call.name, "input": call.input if with_input else {}}


def message_response(
    message_id: str, model: str, text: str, finish_reason: str, usage: dict, tool_call: ToolCall | None = None
) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [tool_use_block(tool_call)] if tool_call is not None else [{"type": "text", "text": text}],
        "stop_reason": STOP_REASONS.get(finish_reason, "end_turn"),
        "stop_sequence": None,
        "usage": usage,
    }


def event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def stream_opening(message_id: str, model: str, prompt_tokens: int, tool_call: ToolCall | None = None) -> list[bytes]:
    message: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }
    block = tool_use_block(tool_call, with_input=False) if tool_call is not None else {"type": "text", "text": ""}
    return [
        event("message_start", {"type": "message_start", "message": message}),
        event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
    ]


def stream_delta(text: str) -> bytes:
    return event(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
    )


def stream_json_delta(partial_json: str) -> bytes:
    """Part of a tool_use block's input, as Anthropic streams it."""
    return event(
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": partial_json},
        },
    )


def stream_closing(finish_reason: str, usage: dict) -> list[bytes]:
    """The closing events; `message_delta` carries the whole usage (`message_usage`), as vLLM's does."""
    return [
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None},
                "usage": usage,
            },
        ),
        event("message_stop", {"type": "message_stop"}),
    ]
