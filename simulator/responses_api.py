"""Pure request parsing, state and response shaping for POST /v1/responses (the OpenAI
Responses API, as vLLM 0.32 serves it), so Responses clients can use the embedded default.

A Responses body renders through the same chat template as /v1/chat/completions, built
the way vLLM's `construct_input_messages` builds it:

    [system: instructions]  (this request's, never carried over)
    + the stored messages of `previous_response_id`, without their system messages
    + the previous response's output text, as an assistant message
    + this request's `input` (a string: one user message; a list: message,
      function_call and function_call_output items)

So a chain of responses keeps its earlier rendering as an exact token prefix, as a chat
client resending its history does. State (`ResponseStore`) lives in the replica's
memory, as in vLLM (which keeps it only with VLLM_ENABLE_RESPONSES_API_STORE=1): a
`previous_response_id` this replica did not produce is a 404, exactly as vLLM answers.
Unlike vLLM's store, this one is bounded (least recently used dropped first).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass

import orjson

from kvgate.simulator.openai_api import ApiError, GenerationParams, _optional, chat_tool_call
from kvgate.simulator.reply_model import ToolCall, function_tools, tool_offer
from kvgate.simulator.tokenizer import TemplateError, render_chat

STORE_MAX_RESPONSES = 10_000


@dataclass(frozen=True)
class StoredResponse:
    """What a continuation needs: the request's chat messages and the generated text, or
    the tool call the reply made."""

    messages: tuple[dict, ...]
    output_text: str
    tool_call: ToolCall | None = None


class ResponseStore:
    """Response id -> StoredResponse, bounded (LRU). Lives as long as the replica."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES) -> None:
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._max = max_responses

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self._max:
            self._responses.popitem(last=False)


@dataclass(frozen=True)
class ResponsesParams:
    """A parsed Responses request: what generation needs and what the answer echoes."""

    generation: GenerationParams
    response_id: str
    messages: tuple[dict, ...]  # stored for a continuation when `store`
    store: bool
    echo: dict  # request fields the response object repeats


def not_found(response_id: str) -> ApiError:
    return ApiError(f"Response with id '{response_id}' not found.", 404, "NotFoundError", "response_id")


def _text_of(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and "type" in part:
                parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
            else:
                raise ApiError(f"{where}.content[{index}] must be a content part object", param="input")
        return "".join(parts)
    raise ApiError(f"{where}.content must be a string or a list of content parts", param="input")


def input_messages(items) -> list[dict]:
    """Chat messages of a Responses `input` (vLLM's `construct_chat_messages_with_tool_call`,
    for the item types agents send; reasoning items carry no prompt text and are skipped)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError("'input' must be a string or a list of input items", param="input")
    messages: list[dict] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(f"{where}.role must be user, assistant, system or developer", param="input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant" and "tool_calls" in previous:
                previous["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else _text_of(output, where),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(f"{where}.type {kind!r} is not supported by the simulated replica", param="input")
    return messages


def chat_messages(body: dict, store: ResponseStore) -> list[dict]:
    """The chat messages a Responses body renders to (module doc); 404 for unknown state."""
    instructions = _optional(body, "instructions", (str,), "a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    previous_id = _optional(body, "previous_response_id", (str,), "a string")
    if previous_id is not None:
        previous = store.get(previous_id)
        if previous is None:
            raise not_found(previous_id)
        messages.extend(m for m in previous.messages if m.get("role") != "system")
        if previous.tool_call is not None:
            messages.append({"role": "assistant", "content": None, "tool_calls": [chat_tool_call(previous.tool_call)]})
        elif previous.output_text:
            messages.append({"role": "assistant", "content": previous.output_text})
    if "input" not in body:
        raise ApiError("'input' is required", param="input")
    messages.extend(input_messages(body["input"]))
    if not messages:
        raise ApiError("the request renders to no messages: give 'input'", param="input")
    return messages


def chat_tools(body: dict) -> list[dict] | None:
    """Responses function tools ({type, name, parameters}) as chat tools, as vLLM renders them."""
    tools = _optional(body, "tools", (list,), "a list")
    if not tools:
        return None
    converted = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function":
            converted.append(
                {
                    "type": "function",
                    "function": {key: tool[key] for key in ("name", "description", "parameters") if key in tool},
                }
            )
    return converted or None


def render_responses(body, store: ResponseStore) -> tuple[list[int], list[dict], str | None]:
    """Prompt token ids, chat messages and cache_salt of a Responses body."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    messages = chat_messages(body, store)
    chat: dict = {"messages": messages}
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
    try:
        ids = render_chat(chat)
    except TemplateError as error:
        raise ApiError(str(error), param="input") from None
    return ids, messages, _optional(body, "cache_salt", (str,), "a string")


def parse_responses(body, served_model: str, max_model_len: int, store: ResponseStore) -> ResponsesParams:
    prompt_ids, messages, cache_salt = render_responses(body, store)
    model = _optional(body, "model", (str,), "a string") or served_model
    stream = _optional(body, "stream", (bool,), "a boolean") or False
    keep = _optional(body, "store", (bool,), "a boolean")
    response_id = _optional(body, "request_id", (str,), "a string") or f"resp_{uuid.uuid4().hex}"
    max_tokens = _optional(body, "max_output_tokens", (int,), "an integer")
    given = max_tokens is not None
    prompt_len = len(prompt_ids)
    if prompt_len >= max_model_len:
        raise ApiError(
            f"The engine prompt length {prompt_len} exceeds the max_model_len {max_model_len}. Please reduce prompt.",
            param="input",
        )
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len  # as vLLM: the context left (the reply ends on its own)
    elif max_tokens < 1:
        raise ApiError(f"'max_output_tokens' must be at least 1, got {max_tokens}", param="max_output_tokens")
    else:
        max_tokens = min(max_tokens, max_model_len - prompt_len)
    echo = {
        key: body.get(key)
        for key in (
            "instructions",
            "metadata",
            "previous_response_id",
            "temperature",
            "top_p",
            "tool_choice",
            "tools",
            "max_output_tokens",
        )
    }
    priority = _optional(body, "priority", (int,), "an integer") or 0  # vLLM's field, as on chat
    offer = tool_offer(function_tools(body.get("tools"), "responses"), body.get("tool_choice"))
    generation = GenerationParams(
        "responses", model, prompt_ids, max_tokens, stream, True, cache_salt, priority, offer, max_tokens_given=given
    )
    return ResponsesParams(generation, response_id, tuple(messages), keep is not False, echo)


# -- the answers ---------------------------------------------------------------------------


def output_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_message(item_id: str, text: str, status: str) -> dict:
    content = [output_part(text)] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(call: ToolCall, status: str) -> dict:
    """A Responses `function_call` output item; its arguments are empty until it completes."""
    arguments = call.arguments if status == "completed" else ""
    return {
        "id": "fc_" + call.key,
        "type": "function_call",
        "call_id": "call_" + call.key,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def output_item(item_id: str, text: str, tool_call: ToolCall | None) -> dict:
    """The completed output item of a reply: its tool call, else its message."""
    return (
        function_call_item(tool_call, "completed")
        if tool_call is not None
        else output_message(item_id, text, "completed")
    )


def response_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    params: ResponsesParams, created: int, status: str, output: list[dict], usage_body: dict | None
) -> dict:
    """The `response` object vLLM returns (and embeds in the stream's lifecycle events).

    vLLM reports `incomplete` (reason max_output_tokens) when generation stopped at the
    token limit, and `completed` when the reply ended on its own."""
    echo = params.echo
    return {
        "id": params.response_id,
        "object": "response",
        "created_at": created,
        "model": params.generation.model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "instructions": echo["instructions"],
        "metadata": echo["metadata"],
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": echo["previous_response_id"],
        "temperature": echo["temperature"] if echo["temperature"] is not None else 1.0,
        "top_p": echo["top_p"] if echo["top_p"] is not None else 1.0,
        "tool_choice": echo["tool_choice"] or "auto",
        "tools": echo["tools"] or [],
        "max_output_tokens": params.generation.max_tokens,
        "background": False,
        "store": params.store,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage_body,
    }


def stored_response_object(response_id: str, stored: StoredResponse, model: str) -> dict:
    """What GET /v1/responses/{id} answers for a stored response: its id and output."""
    return {
        "id": response_id,
        "object": "response",
        "model": model,
        "status": "completed",
        "output": [output_item("msg_" + response_id, stored.output_text, stored.tool_call)],
        "store": True,
    }


def final_status(finish_reason: str) -> str:
    """`finish_reason` in chat's words (`ReplyPlan.finish_reason`)."""
    return "incomplete" if finish_reason == "length" else "completed"


def event(kind: str, sequence_number: int, **fields) -> bytes:
    """One Responses stream event as vLLM writes it: `event: <type>` and its JSON."""
    data = {"type": kind, "sequence_number": sequence_number, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class ResponseStream:
    """The event sequence of one streamed response (the simple, non-harmony path of
    vLLM's `responses_stream_generator`), numbering events as it goes:

    response.created, response.in_progress, then on the first text
    response.output_item.added and response.content_part.added, one
    response.output_text.delta per engine step, and at the end
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed (whose response carries the output and usage).

    A reply that is a tool call (`tool_call`) has one function_call item instead:
    response.output_item.added, response.function_call_arguments.delta per step,
    response.function_call_arguments.done, response.output_item.done."""

    def __init__(self, params: ResponsesParams, created: int, tool_call: ToolCall | None = None) -> None:
        self.params = params
        self.created = created
        self.tool_call = tool_call
        self.item_id = f"fc_{tool_call.key}" if tool_call is not None else f"msg_{uuid.uuid4().hex}"
        self.text_parts: list[str] = []
        self._sequence = 0
        self._opened = False

    def _event(self, kind: str, **fields) -> bytes:
        data = event(kind, self._sequence, **fields)
        self._sequence += 1
        return data

    def opening(self) -> list[bytes]:
        initial = response_object(self.params, self.created, "in_progress", [], None)
        return [
            self._event("response.created", response=initial),
            self._event("response.in_progress", response=initial),
        ]

    def _open(self) -> list[bytes]:
        self._opened = True
        if self.tool_call is not None:
            item = function_call_item(self.tool_call, "in_progress")
            return [self._event("response.output_item.added", output_index=0, item=item)]
        part = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self._event(
                "response.output_item.added", output_index=0, item=output_message(self.item_id, "", "in_progress")
            ),
            self._event("response.content_part.added", **part, part=output_part("")),
        ]

    def delta(self, text: str) -> list[bytes]:
        """Events for the next piece of the reply: text, or a tool call's arguments."""
        if not text:
            return []
        events = [] if self._opened else self._open()
        self.text_parts.append(text)
        if self.tool_call is not None:
            events.append(
                self._event("response.function_call_arguments.delta", item_id=self.item_id, output_index=0, delta=text)
            )
            return events
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _done(self, text: str) -> tuple[list[bytes], dict]:
        if self.tool_call is not None:
            item = function_call_item(self.tool_call, "completed")
            done = self._event(
                "response.function_call_arguments.done", item_id=self.item_id, output_index=0, arguments=text
            )
            return [done], item
        item = output_message(self.item_id, text, "completed")
        part = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_text.done", **part, text=text, logprobs=[]),
            self._event("response.content_part.done", **part, part=output_part(text)),
        ], item

    def closing(self, finish_reason: str, usage_body: dict) -> list[bytes]:
        """The closing events; `finish_reason` in chat's words (`ReplyPlan.finish_reason`)."""
        events = []
        output = []
        if self._opened:
            done, item = self._done("".join(self.text_parts))
            events.extend(done)
            output.append(item)
            events.append(self._event("response.output_item.done", output_index=0, item=item))
        final = response_object(self.params, self.created, final_status(finish_reason), output, usage_body)
        events.append(self._event("response.completed", response=final))
        return events

    def failed(self, error: ApiError) -> list[bytes]:
        return [self._event("error", code=str(error.status), message=error.message, param=error.param)]
