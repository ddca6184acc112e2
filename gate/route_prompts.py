"""What a request body says about its prompt, per route kind (pure).

The working_set policy bounds a turn's prompt by its body's bytes (`prompt_token_bound`),
which holds only when the body carries the whole prompt. A Responses body that
continues `previous_response_id` does not: the server prepends the conversation it
holds for that response (vLLM's `response_store`), so its bytes bound nothing and the
turn must be priced by the prefix probe, which renders it with that state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import orjson

# The body fields that make a turn what it is, on every route kind: its prompt (chat and
# Anthropic `messages` and `system`, completions' `prompt`, Responses' `input`,
# `instructions` and the response it continues) and the tools it may call.
TURN_FIELDS = ("messages", "system", "prompt", "input", "instructions", "previous_response_id", "tools")


def body_holds_prompt(route_kind: str, body: Mapping[str, object]) -> bool:
    """True when every prompt token comes from the body (and the template)."""
    return not (route_kind == "responses" and body.get("previous_response_id") is not None)


def turn_key(route_kind: str, body: Mapping[str, object]) -> str:
    """The identity of a turn: equal for a re-sent request (a client's retry, an agent
    re-sending after a timeout), different for the distinct requests one session sends at
    once (a main turn beside a title or summary request, parallel subagents). Sampling
    settings (`stream`, `max_tokens`, `temperature`, ...) do not count: a retry may change
    them. A digest, so the books hold 32 bytes per attempt, not the prompt."""
    fields = {name: body[name] for name in TURN_FIELDS if name in body}
    try:
        encoded = orjson.dumps([route_kind, fields], option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON data (only in-process callers): every such body is its own turn
        encoded = repr((route_kind, id(body))).encode()
    return hashlib.blake2b(encoded, digest_size=16).hexdigest()
