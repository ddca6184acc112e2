"""The agentic benchmark's client APIs: how a turn is sent and its stream read, per API.

Every API sends the same conversation, so every API renders the same prompt (system,
task, then reply and tool result per turn) and the hit rates compare like for like:

- `chat`: `/v1/chat/completions` with the whole history, session id in the
  `x-session-id` header (the benchmark's historical client);
- `messages`: Anthropic `/v1/messages` with the whole history, `system` apart, and the
  session id as Claude Code sends it: `metadata.user_id` = a JSON string holding
  `session_id`;
- `responses`: OpenAI `/v1/responses` chained with `previous_response_id` (only the new
  user input is sent; the server holds the rest), `store` left at its default, and the
  session id in `prompt_cache_key` (as Codex CLI sends its conversation id).

All stream. `StreamState.on_event` reads one SSE data object of its API: reply text,
first-token time, prompt and cached token counts, the response id, errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from kvgate.bench.agentic.workload import SessionPlan, build_messages

APIS = ("chat", "messages", "responses")
API_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
SESSION_HEADER = "x-session-id"


def turn_request(
    api: str,
    model: str,
    session: SessionPlan,
    turn_index: int,
    replies: list[str],
    reply_tokens: int,
    previous_response_id: str | None,
    max_tokens: int | None = None,
    stop: tuple[str, ...] = (),
) -> tuple[dict, dict]:
    """(body, headers) of turn `turn_index` of `session` in `api` (finish header not included).

    `responses` continues `previous_response_id` (the last turn's response) from turn 2 on.
    `max_tokens`: the cap the turn sends, its reply still `reply_tokens` long (vLLM's
    `min_tokens`, where simulated replicas stop: chat only); None: the reply's length.
    `stop`: stop strings the capped turn sends, which vLLM looks for only after
    `min_tokens`, so a model that would not end by itself (random weights) ends there; its
    tokens are then sampled (temperature 1), so a stop string comes within a few. Without a
    seed: each run's texts differ, their lengths hardly (vLLM 0.32 on CPU kills its engine
    on a request's own seed: "CPU Generator does not use offset")."""
    messages = build_messages(session, replies, turn_index)
    if max_tokens is not None and api != "chat":
        raise ValueError(f"a workload with max_tokens runs the chat api only (got {api!r})")
    if stop and max_tokens is None:
        raise ValueError("stop strings end a capped turn's reply: they need max_tokens")
    if api == "chat":
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": reply_tokens if max_tokens is None else max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if max_tokens is not None:
            body["min_tokens"] = reply_tokens
        if stop:
            body.update(stop=list(stop), temperature=1.0)
        return body, {SESSION_HEADER: session.session_id}
    if api == "messages":
        system, *conversation = messages
        body = {
            "model": model,
            "system": system["content"],
            "messages": conversation,
            "max_tokens": reply_tokens,
            "temperature": 0.0,
            "stream": True,
            "metadata": {"user_id": orjson.dumps({"session_id": session.session_id}).decode()},
        }
        return body, {}
    if api == "responses":
        body = {
            "model": model,
            "instructions": messages[0]["content"],
            "max_output_tokens": reply_tokens,
            "temperature": 0.0,
            "stream": True,
            "prompt_cache_key": session.session_id,
        }
        if turn_index == 1:
            body["input"] = messages[1:]
        else:
            if previous_response_id is None:
                raise ValueError(f"turn {turn_index} of a responses chain needs the previous response id")
            body["previous_response_id"] = previous_response_id
            body["input"] = messages[-1:]  # the new tool result; the server holds the rest
        return body, {}
    raise ValueError(f"unknown api {api!r}; choose from {', '.join(APIS)}")


@dataclass
class StreamState:
    """What one streamed answer told so far."""

    api: str
    text_parts: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    response_id: str | None = None
    error: dict | None = None

    def on_event(self, event: dict) -> bool:
        """Take one SSE data object; True when it is the first generated token's event."""
        kind = event.get("type")
        if kind in ("error", "response.failed") or (kind is None and "error" in event):
            self.error = event
            return False
        return getattr(self, "_" + self.api)(event)

    def _chat(self, event: dict) -> bool:
        first = False
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            # A token chunk: not the role announcement; its text may be empty (special tokens).
            if "role" not in delta and ("content" in delta or choice.get("finish_reason")):
                first = first or not self.text_parts
                self.text_parts.append(delta.get("content") or "")
        usage = event.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens")
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return first

    def _messages(self, event: dict) -> bool:
        kind = event.get("type")
        if kind == "message_start":
            usage = (event.get("message") or {}).get("usage") or {}
            self.prompt_tokens = usage.get("input_tokens")
            self.response_id = (event.get("message") or {}).get("id")
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            first = not self.text_parts
            self.text_parts.append(delta.get("text") or "")
            return first
        elif kind == "message_delta":
            usage = event.get("usage") or {}
            if usage.get("cache_read_input_tokens") is not None:
                self.cached_tokens = usage["cache_read_input_tokens"]
                # Anthropic's input_tokens excludes the tokens read from and written to the
                # cache when the server reports them (vLLM with --enable-prompt-tokens-details)
                if self.prompt_tokens is not None and usage.get("input_tokens") is not None:
                    created = usage.get("cache_creation_input_tokens") or 0
                    self.prompt_tokens = usage["input_tokens"] + self.cached_tokens + created
        return False

    def _responses(self, event: dict) -> bool:
        kind = event.get("type")
        if kind == "response.created":
            self.response_id = (event.get("response") or {}).get("id")
        elif kind == "response.output_text.delta":
            first = not self.text_parts
            self.text_parts.append(event.get("delta") or "")
            return first
        elif kind == "response.completed":
            response = event.get("response") or {}
            self.response_id = response.get("id") or self.response_id
            usage = response.get("usage") or {}
            self.prompt_tokens = usage.get("input_tokens")
            self.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        return False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)
