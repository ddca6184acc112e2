"""What a request body says about its prompt, per route kind (pure).

The working_set policy bounds a turn's prompt by its body's bytes (`prompt_token_bound`),
which holds only when the body carries the whole prompt. A Responses body that
continues `previous_response_id` does not: the server prepends the conversation it
holds for that response (vLLM's `response_store`), so its bytes bound nothing and the
turn must be priced by the prefix probe, which renders it with that state.
"""

from __future__ import annotations

from collections.abc import Mapping


def body_holds_prompt(route_kind: str, body: Mapping[str, object]) -> bool:
    """True when every prompt token comes from the body (and the template)."""
    return not (route_kind == "responses" and body.get("previous_response_id") is not None)
