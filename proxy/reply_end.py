"""How a turn's reply ended, and whether that ended its agent's run.

An agent loop (Claude Code, Codex CLI, the OpenAI Agents SDK, an RL rollout's policy)
sends the model the conversation with its tools, runs the tool calls the reply makes,
and sends the next turn; it stops when a reply calls no tool. That reply is the run's
last turn: what comes next in the session, if anything, is a person's next message, not
a tool result a few seconds away. It is as exact a signal as `x-session-finish`, given by
every agent without its saying anything, so kvgate ends the session's window on it
(`session.finish_on_final_reply`).

Each API says it its own way (`reply_end_of`):
- `chat`: each choice's `finish_reason`: `tool_calls` (a tool call), `stop` (said its
  piece), `length` (cut at `max_tokens`); a stream says it in the last content chunk;
- `messages` (Anthropic): `stop_reason`: `tool_use`, `end_turn` / `stop_sequence`,
  `max_tokens` (`pause_turn` and `refusal`: neither); a stream, in `message_delta`;
- `responses`: a `function_call` (or another tool call) among the `output` items, else
  `status` `completed` (`incomplete`: cut); a stream, in `response.completed`.

Only a reply that chose not to call a tool ends a run (`ends_agent_run`): the request
listed tools and left the choice to the model (`tool_choice` absent or auto). A request
with no tools, or `tool_choice` none, is a plain chat turn or a step inside the loop (a
summary, a title), and its reply says nothing of the run; one that forces a tool gets a
call whatever its finish reason says (vLLM answers a forced call with `stop`). A reply
cut at its cap ends nothing either: the agent may go on. Pure functions; a malformed answer is
`UNKNOWN`, never an error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import Enum

# `"finish_reason":"stop"` in a chat stream's chunks (every content chunk has the key, with
# null until the last): matched as bytes, not parsed, since most chunks carry no end.
FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([a-z_]+)"')


class ReplyEnd(Enum):
    """How a reply ended."""

    TOOL_CALL = "tool_call"  # it calls a tool: the agent runs it and comes back
    FINAL = "final"  # it said its piece without calling a tool
    CUT = "cut"  # stopped at its token cap (or an end that is neither)
    UNKNOWN = "unknown"  # not said, or not readable


_CHAT_ENDS = {"tool_calls": ReplyEnd.TOOL_CALL, "function_call": ReplyEnd.TOOL_CALL, "stop": ReplyEnd.FINAL}
_ANTHROPIC_ENDS = {"tool_use": ReplyEnd.TOOL_CALL, "end_turn": ReplyEnd.FINAL, "stop_sequence": ReplyEnd.FINAL}
_RESPONSES_TOOL_ITEMS = frozenset(
    {"function_call", "custom_tool_call", "mcp_call", "computer_call", "local_shell_call", "shell_call"}
)


def combined(ends: list[ReplyEnd]) -> ReplyEnd:
    """The end of a reply of several choices (or said in several places): a tool call if
    any calls one, final only if every one is final."""
    if not ends:
        return ReplyEnd.UNKNOWN
    if ReplyEnd.TOOL_CALL in ends:
        return ReplyEnd.TOOL_CALL
    if all(end is ReplyEnd.FINAL for end in ends):
        return ReplyEnd.FINAL
    return ReplyEnd.UNKNOWN if ReplyEnd.UNKNOWN in ends else ReplyEnd.CUT


def _end_named(reason: object, ends: Mapping[str, ReplyEnd]) -> ReplyEnd:
    """The end an API's reason names (`ends`); another reason is CUT, none UNKNOWN."""
    if not isinstance(reason, str):
        return ReplyEnd.UNKNOWN
    return ends.get(reason, ReplyEnd.CUT)


def chat_end(reason: object) -> ReplyEnd:
    """A chat or completion choice's `finish_reason`."""
    return _end_named(reason, _CHAT_ENDS)


def _responses_end(response: Mapping) -> ReplyEnd:
    output = response.get("output")
    if not isinstance(output, list):
        return ReplyEnd.UNKNOWN
    if any(isinstance(item, dict) and item.get("type") in _RESPONSES_TOOL_ITEMS for item in output):
        return ReplyEnd.TOOL_CALL
    status = response.get("status")
    if status == "completed":
        return ReplyEnd.FINAL
    return ReplyEnd.CUT if status == "incomplete" else ReplyEnd.UNKNOWN


def reply_end_of(doc: object, kind: str) -> ReplyEnd:
    """How the answer object (or the stream event that says it) of route `kind` ended:
    a chat or completion answer, an Anthropic message or its `message_delta` event, a
    response or its `response.completed` event. UNKNOWN where it does not say."""
    if not isinstance(doc, dict):
        return ReplyEnd.UNKNOWN
    if kind == "messages":
        delta = doc.get("delta")
        reason = delta.get("stop_reason") if isinstance(delta, dict) else doc.get("stop_reason")
        return _end_named(reason, _ANTHROPIC_ENDS)
    if kind == "responses":
        response = doc["response"] if isinstance(doc.get("response"), dict) else doc  # a stream event's
        return _responses_end(response)
    choices = doc.get("choices")
    if not isinstance(choices, list) or not choices:
        return ReplyEnd.UNKNOWN
    return combined([_choice_end(choice) for choice in choices])


def _choice_end(choice: object) -> ReplyEnd:
    """A chat answer's choice: its message's tool calls, else its finish reason."""
    if not isinstance(choice, dict):
        return ReplyEnd.UNKNOWN
    message = choice.get("message")
    if isinstance(message, dict) and message.get("tool_calls"):
        return ReplyEnd.TOOL_CALL
    return chat_end(choice.get("finish_reason"))


def stream_chat_end(data: bytes) -> ReplyEnd | None:
    """The end a chat or completion stream's bytes say (the last `finish_reason` that is
    not null, of each choice: a tool call if any), or None where none is in `data`."""
    ends = [chat_end(match.group(1).decode()) for match in FINISH_REASON.finditer(data)]
    return combined(ends) if ends else None


def leaves_tools_to_model(body: Mapping[str, object]) -> bool:
    """Whether a request lets the model choose between calling a tool and answering: it
    lists tools, and its `tool_choice` is absent or auto (`"auto"`, or Anthropic's
    `{"type": "auto"}`), not none, required or a named tool."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return False
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = choice.get("type")
    return choice is None or choice == "auto"


def ends_agent_run(body: Mapping[str, object], end: ReplyEnd) -> bool:
    """Whether a turn ended its agent's run: the model, free to call a tool, answered
    without one and was not cut."""
    return end is ReplyEnd.FINAL and leaves_tools_to_model(body)
