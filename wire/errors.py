"""The error envelopes kvgate's processes answer with: OpenAI's and Anthropic's.

- OpenAI (every route but `/v1/messages`, and the probe API):
  `{"error": {"message", "type", "param", "code"}}`.
- Anthropic (`/v1/messages`): `{"type": "error", "error": {"type", "message"}}`, the
  shape Anthropic's SDKs parse, with kvgate's machine-readable `code` beside them.

Who answers picks the `type`: the proxy's own errors take `openai_type(status)` or
`anthropic_type(status)`, the vLLM plugin and the simulated replica take vLLM's names.
"""

from __future__ import annotations

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "api_error",
    502: "upstream_error",
    503: "service_unavailable",
}
# Anthropic's error types (docs.anthropic.com, Errors); a client that dispatches on the
# type (retry an overloaded_error, not an invalid_request_error) sees kvgate's the same way.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "api_error")


def anthropic_type(status: int) -> str:
    """Anthropic's type for `status`: its own table, else by class (4xx a bad request, 5xx an API error)."""
    return ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "api_error")


def openai_error(message: str, type_: str, code: str | int | None, param: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`: the envelope OpenAI and vLLM answer with."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def anthropic_error(message: str, type_: str, code: str | None = None) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`, plus kvgate's `code` when there is one."""
    error: dict = {"type": type_, "message": message}
    if code is not None:
        error["code"] = code
    return {"type": "error", "error": error}
