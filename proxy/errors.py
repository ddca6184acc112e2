"""kvgate's own error responses, in the envelopes of `kvgate.wire.errors`.

Pure request checks raise `RequestRejected`; the HTTP shell turns it into a response
with `send_error`. Every message says what the client should do about it.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson

from kvgate.wire.errors import anthropic_error, openai_error, openai_type


class RequestRejected(Exception):
    """A request the proxy refuses before forwarding it."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def error_json(status: int, message: str, code: str | None, type_: str | None = None) -> bytes:
    return orjson.dumps(openai_error(message, type_ or openai_type(status), code))


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
        return b"event: error\ndata: " + orjson.dumps(anthropic_error(message, "api_error", code)) + b"\n\n"
    return b"data: " + orjson.dumps(openai_error(message, "upstream_error", code)) + b"\n\n"
