"""The routes kvgate forwards (docs/reference.md, Forwarded routes), and the kind of each.

A route's kind names its body format: the gate prices a turn by it, the prefix probe
renders the body under a key of that name (`{"chat": body}`), and a replica serves it.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

RouteKind = Literal["chat", "completion", "messages", "responses", "models", "passthrough"]


class RouteSpec(NamedTuple):
    method: str
    path: str  # the upstream path, also the proxy path without the /sess/{id} prefix
    kind: RouteKind  # PASSTHROUGH: forwarded to the session's replica without the gate
    has_body: bool


ROUTES = (
    RouteSpec("POST", "/v1/chat/completions", "chat", True),
    RouteSpec("POST", "/v1/completions", "completion", True),
    RouteSpec("POST", "/v1/messages", "messages", True),
    RouteSpec("POST", "/v1/responses", "responses", True),
    RouteSpec("GET", "/v1/models", "models", False),
)
PATHS = {route.kind: route.path for route in ROUTES}

# Every other route vLLM serves is forwarded to the session's replica without the gate:
# token counting (`/v1/messages/count_tokens`), the Responses API's retrieve, cancel,
# delete and input_items, embeddings, tokenize and detokenize, pooling and scoring, ...
# Their kind (the `route` label of kvgate_requests_total):
PASSTHROUGH: RouteKind = "passthrough"
# vLLM's routes outside /v1 and /v2 that clients call (tokenizer, pooling, scoring, SageMaker's).
VLLM_TOP_LEVEL_ROUTES = frozenset(
    {"/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/invocations", "/version"}
)
# kvgate's own protocol with the replicas (the probe API, the owner record: `probe_api`,
# `owner_record`), which only gates may use and is never relayed for clients.
REPLICA_API_PREFIX = "/v1/kvgate/"
_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(?:/cancel|/input_items)?")


def passthrough_route(method: str, path: str) -> RouteSpec | None:
    """The route of a request kvgate forwards ungated, or None: any path under /v1/ or /v2/
    that is not a gated route (the caller looks those up first) nor the replica API, and
    vLLM's top-level API routes. vLLM answers the ones it does not serve."""
    if path.startswith(("/v1/", "/v2/")) and not path.startswith(REPLICA_API_PREFIX) or path in VLLM_TOP_LEVEL_ROUTES:
        return RouteSpec(method, path, PASSTHROUGH, True)
    return None


def response_id_of(path: str) -> str | None:
    """The response a Responses API route names (`/v1/responses/{id}`, `.../cancel`,
    `.../input_items`): it lives on the replica that produced it."""
    match = _RESPONSE_PATH.fullmatch(path)
    return match.group(1) if match else None


# Kinds whose body carries a prompt: the turns of a session. The gate admits them, the
# prefix probe renders them, `kvgate_turn_seconds` counts them. Anything else (the models
# list) never touches the gate.
PROMPT_KINDS: frozenset[RouteKind] = frozenset({"chat", "completion", "messages", "responses"})
# Kinds whose vLLM body accepts vLLM's own `priority` field (priority scheduling).
PRIORITY_FIELD_KINDS: frozenset[RouteKind] = frozenset({"chat", "completion", "responses"})
# Kinds whose vLLM body accepts vLLM's own `session_id` field.
SESSION_FIELD_KINDS: frozenset[RouteKind] = frozenset({"chat", "completion", "responses"})
