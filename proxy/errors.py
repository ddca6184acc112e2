"""OpenAI-shaped error responses: `{"error": {"message", "type", "code"}}`.

Pure request checks raise `RequestRejected`; the HTTP shell turns it into a response
with `send_error`. Every message says what the client should do about it.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    405: "invalid_request_error",
    431: "invalid_request_error",
    500: "api_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
}


class RequestRejected(Exception):
    """A request the proxy refuses before forwarding it."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def error_payload(message: str, type_: str, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code}}


def error_json(status: int, message: str, code: str | None, type_: str | None = None) -> bytes:
    return orjson.dumps(error_payload(message, type_ or _STATUS_TYPES.get(status, "api_error"), code))


JSON_CONTENT_TYPE = (b"Content-Type", b"application/json")


def send_error(
    responder,
    status: int,
    message: str,
    code: str | None,
    headers: Iterable[tuple[bytes, bytes]] = (),
    type_: str | None = None,
    close: bool = False,
) -> None:
    """Answer with an OpenAI-shaped error through a `proxy.http_server.Responder`."""
    responder.send(status, error_json(status, message, code, type_), [JSON_CONTENT_TYPE, *headers], close=close)


def sse_error_event(message: str, code: str, anthropic: bool = False) -> bytes:
    """The event that ends a stream whose upstream broke after the headers went out.

    OpenAI clients read `data: {"error": ...}`; Anthropic clients dispatch on the
    `event:` line and expect `{"type": "error", "error": {...}}`, so that route gets both.
    """
    if anthropic:
        payload = {"type": "error", "error": {"type": "api_error", "message": message, "code": code}}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"
    return b"data: " + orjson.dumps(error_payload(message, "upstream_error", code)) + b"\n\n"
