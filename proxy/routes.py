"""The forwarded routes (docs/reference.md, Forwarded routes) and the kind each one is to the gate."""

from __future__ import annotations

from typing import NamedTuple


class RouteSpec(NamedTuple):
    method: str
    path: str  # the upstream path, also the proxy path without the /sess/{id} prefix
    kind: str  # Seam 1 route_kind: chat | completion | messages | responses | models
    has_body: bool


ROUTES = (
    RouteSpec("POST", "/v1/chat/completions", "chat", True),
    RouteSpec("POST", "/v1/completions", "completion", True),
    RouteSpec("POST", "/v1/messages", "messages", True),
    RouteSpec("POST", "/v1/responses", "responses", True),
    RouteSpec("GET", "/v1/models", "models", False),
)

# Kinds that are turns of a session (counted for kvgate_turn_seconds).
TURN_KINDS = frozenset({"chat", "completion", "messages", "responses"})
# Kinds whose vLLM body accepts vLLM's own `session_id` field.
SESSION_FIELD_KINDS = frozenset({"chat", "completion", "responses"})
