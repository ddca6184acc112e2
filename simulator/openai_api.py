"""Pure request parsing and response shaping for the simulated replica's OpenAI routes.

No I/O here: `parse_generation` turns a parsed JSON body into `GenerationParams` or
raises `ApiError` (rendered as vLLM's error body); the `*_response` / `*_chunk` functions
build the exact JSON objects vLLM returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.simulator.reply_model import NO_TOOLS, ToolCall, ToolOffer, function_tools, tool_offer
from kvgate.simulator.tokenizer import TemplateError, render_chat, render_completion_prompt
from kvgate.wire.errors import openai_error

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's and vLLM's


class ApiError(Exception):
    """An error answered as vLLM does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        error_type: str = "BadRequestError",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type
        self.param = param
        self.code = code  # None: the status, as vLLM's own errors; the probe API's name theirs

    def body(self) -> dict:
        return openai_error(self.message, self.error_type, self.status if self.code is None else self.code, self.param)


@dataclass(frozen=True)
class GenerationParams:
    kind: str  # "chat" | "completion" | "messages" | "responses"
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    priority: int = 0  # vLLM's request field: lower is served first under priority scheduling
    offer: ToolOffer = NO_TOOLS  # the function tools the reply may call
    fixed_length: bool = False  # vLLM's `ignore_eos`: exactly max_tokens tokens of text
    max_tokens_given: bool = True  # False: max_tokens is the default cap (the context left)
    min_tokens: int = 0  # vLLM's `min_tokens`: no stop before this many


def _optional(body: dict, key: str, types: tuple, what: str):
    value = body.get(key)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise ApiError(f"'{key}' must be {what}", param=key)
    return value


def render_prompt(kind: str, body) -> tuple[list[int], str | None]:
    """Prompt token ids and cache_salt of a chat or completion body, as generation renders them."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    cache_salt = _optional(body, "cache_salt", (str,), "a string")
    try:
        if kind == "chat":
            if "messages" not in body:
                raise ApiError("'messages' is required", param="messages")
            ids = render_chat(body)
        else:
            if "prompt" not in body:
                raise ApiError("'prompt' is required", param="prompt")
            ids = render_completion_prompt(body["prompt"])
    except TemplateError as error:
        raise ApiError(str(error)) from None
    return ids, cache_salt


def parse_generation(kind: str, body, served_model: str, max_model_len: int) -> GenerationParams:
    prompt_ids, cache_salt = render_prompt(kind, body)
    model = _optional(body, "model", (str,), "a string") or served_model
    stream = _optional(body, "stream", (bool,), "a boolean") or False
    stream_options = _optional(body, "stream_options", (dict,), "an object") or {}
    include_usage = bool(stream_options.get("include_usage", False))
    n = _optional(body, "n", (int,), "an integer")
    if n is not None and n != 1:
        raise ApiError("the simulated replica supports n=1 only", param="n")
    fixed_length = bool(_optional(body, "ignore_eos", (bool,), "a boolean"))  # as vLLM: no stop before the cap
    _optional(body, "session_id", (str,), "a string")  # vLLM's field: accepted and ignored
    # vLLM's field; under fcfs scheduling it is accepted and has no effect, as in vLLM
    priority = _optional(body, "priority", (int,), "an integer") or 0
    max_tokens: int | None = None
    for key in ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",):
        value = _optional(body, key, (int,), "an integer")
        if value is not None:
            if value < 1:
                raise ApiError(f"'{key}' must be at least 1, got {value}", param=key)
            max_tokens = value
            break
    given = max_tokens is not None
    min_tokens = _optional(body, "min_tokens", (int,), "an integer") or 0
    if min_tokens < 0 or max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(f"'min_tokens' must be between 0 and max_tokens, got {min_tokens}", param="min_tokens")
    prompt_len = len(prompt_ids)
    if prompt_len >= max_model_len:
        raise ApiError(
            f"The decoder prompt (length {prompt_len}) is longer than the maximum model length of {max_model_len}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens."
        )
    if max_tokens is None:
        # as vLLM: a chat reply may use the context left (it ends on its own, reply_model),
        # a completion stops at 16 tokens
        left = max_model_len - prompt_len
        max_tokens = left if kind == "chat" else min(DEFAULT_MAX_TOKENS, left)
    elif prompt_len + max_tokens > max_model_len:
        where = "messages" if kind == "chat" else "prompt"
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the completion). "
            f"Please reduce the length of the {where} or completion."
        )
    offer = (
        tool_offer(function_tools(body.get("tools"), "chat"), body.get("tool_choice")) if kind == "chat" else NO_TOOLS
    )
    return GenerationParams(
        kind,
        model,
        prompt_ids,
        max_tokens,
        stream,
        include_usage,
        cache_salt,
        priority,
        offer,
        fixed_length,
        given,
        min(min_tokens, max_tokens),
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def chat_tool_call(call: ToolCall) -> dict:
    return {"id": "call_" + call.key, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_tool_call_delta(call: ToolCall, arguments: str, first: bool) -> dict:
    """A stream's delta for part of a tool call: the first names it, the rest add arguments."""
    if first:
        opened = {"index": 0, "id": "call_" + call.key, "type": "function"}
        return {"tool_calls": [{**opened, "function": {"name": call.name, "arguments": arguments}}]}
    return {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}


def chat_response(
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    usage_body: dict,
    tool_call: ToolCall | None = None,
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
    if tool_call is not None:
        message = {"role": "assistant", "content": None, "tool_calls": [chat_tool_call(tool_call)]}
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": usage_body,
    }


def completion_response(
    request_id: str, created: int, model: str, text: str, finish_reason: str, usage_body: dict
) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
        "usage": usage_body,
    }


def chat_chunk(request_id: str, created: int, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def completion_chunk(request_id: str, created: int, model: str, text: str, finish_reason: str | None) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
    }


def usage_chunk(request_id: str, created: int, model: str, kind: str, usage_body: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body,
    }


def models_response(model: str, created: int, max_model_len: int) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [],
            }
        ],
    }
