"""The routes kvgate forwards (docs/reference.md, Forwarded routes), and the kind of each.

A route's kind names its body format: the gate prices a turn by it, the prefix probe
renders the body under a key of that name (`{"chat": body}`), and a replica serves it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

RouteKind = Literal["chat", "completion", "messages", "responses", "models"]


class RouteSpec(NamedTuple):
    method: str
    path: str  # the upstream path, also the proxy path without the /sess/{id} prefix
    kind: RouteKind
    has_body: bool


ROUTES = (
    RouteSpec("POST", "/v1/chat/completions", "chat", True),
    RouteSpec("POST", "/v1/completions", "completion", True),
    RouteSpec("POST", "/v1/messages", "messages", True),
    RouteSpec("POST", "/v1/responses", "responses", True),
    RouteSpec("GET", "/v1/models", "models", False),
)
PATHS = {route.kind: route.path for route in ROUTES}

# Kinds whose body carries a prompt: the turns of a session. The gate admits them, the
# prefix probe renders them, `kvgate_turn_seconds` counts them. Anything else (the models
# list) never touches the gate.
PROMPT_KINDS: frozenset[RouteKind] = frozenset({"chat", "completion", "messages", "responses"})
# Kinds whose vLLM body accepts vLLM's own `session_id` field.
SESSION_FIELD_KINDS: frozenset[RouteKind] = frozenset({"chat", "completion", "responses"})
