"""Validate a ``POST /v1/kvgate/prefix`` body (pure; no vLLM imports).

Accepted bodies (docs/reference.md), exactly one of:

- ``{"token_ids": [int, ...], "cache_salt"?: str, "model"?: str}``
- ``{"chat": <a /v1/chat/completions body>}``
- ``{"completion": <a /v1/completions body>}``
- ``{"messages": <an Anthropic /v1/messages body>}``
- ``{"responses": <a /v1/responses body>}``

Anything else raises ``ProbeRequestError``, which the endpoint turns into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

PromptKind = Literal["token_ids", "chat", "completion", "messages", "responses"]
PROMPT_KINDS: tuple[PromptKind, ...] = get_args(PromptKind)


class ProbeRequestError(ValueError):
    """A probe body the server cannot answer; ``status`` is the HTTP status to send."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def too_long(num_tokens: int, max_model_len: int) -> ProbeRequestError:
    """The refusal of a prompt the server can never serve: a probe costs no more than its turn."""
    return ProbeRequestError(
        f"the prompt has {num_tokens} tokens, more than this server's max_model_len ({max_model_len}); "
        "it can never be served here",
        code="prompt_too_long",
    )


@dataclass(frozen=True)
class PrefixQuery:
    """A validated prefix probe. ``token_ids`` is set for kind "token_ids";
    ``body`` (the request dict of that route) for the other kinds."""

    kind: PromptKind
    token_ids: list[int] | None = None
    cache_salt: str | None = None
    model: str | None = None
    body: dict | None = None


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ProbeRequestError(f"'{key}' must be a string", param=key)
    return value


def parse_prefix_query(body: object, max_model_len: int | None = None) -> PrefixQuery:
    """The validated query, or ``ProbeRequestError`` naming the offending field. ``token_ids``
    longer than ``max_model_len`` are refused (``prompt_too_long``) before a single id is read."""
    if not isinstance(body, dict):
        raise ProbeRequestError("the prefix probe body must be a JSON object")
    present = [kind for kind in PROMPT_KINDS if kind in body]
    if len(present) != 1:
        raise ProbeRequestError(
            "give exactly one of 'token_ids', 'chat' (a /v1/chat/completions body), "
            "'completion' (a /v1/completions body), 'messages' (an Anthropic /v1/messages body) "
            f"or 'responses' (a /v1/responses body); got {present or 'none'}"
        )
    kind = present[0]
    if kind == "token_ids":
        token_ids = body["token_ids"]
        if isinstance(token_ids, list) and max_model_len is not None and len(token_ids) > max_model_len:
            raise too_long(len(token_ids), max_model_len)
        if (
            not isinstance(token_ids, list)
            or not token_ids
            or not all(type(token) is int and token >= 0 for token in token_ids)
        ):
            raise ProbeRequestError("'token_ids' must be a non-empty list of non-negative integers", param="token_ids")
        return PrefixQuery(
            kind="token_ids",
            token_ids=token_ids,
            cache_salt=_optional_str(body, "cache_salt"),
            model=_optional_str(body, "model"),
        )
    request_body = body[kind]
    if not isinstance(request_body, dict):
        raise ProbeRequestError(f"'{kind}' must be a JSON object (a request body)", param=kind)
    return PrefixQuery(kind=kind, body=request_body)
