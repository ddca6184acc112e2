"""kvgate's own error responses, in the envelopes of `kvgate.wire.errors`.

Pure request checks raise `RequestRejected`; the HTTP shell turns it into a response
with `send_error`. Every message says what the client should do about it.

The envelope follows the API the client speaks: Anthropic's on the Messages API
(`/v1/messages` and the routes below it, also under `/sess/{id}/`), so Anthropic's SDKs
parse kvgate's refusals (admission, bad input, no healthy replica, ...) as they parse the
API's own; OpenAI's everywhere else. The app sets `Responder.error_shape` from the path
(`error_shape`) before it handles a request, and every error it sends takes that shape.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson

from kvgate.wire.errors import anthropic_error, anthropic_type, openai_error, openai_type
from kvgate.wire.routes import PATHS

OPENAI = "openai"
ANTHROPIC = "anthropic"
_MESSAGES_PATH = PATHS["messages"]


SHOWN_CHARS = 80  # the most of a client's or the config's value that a message shows


def clipped(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text`, cut short (with its length) when longer than `limit`: messages stay one short line."""
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


def error_shape(path: str) -> str:
    """ANTHROPIC for the Messages API's paths (with or without the /sess/{id} prefix), else OPENAI."""
    if path.startswith("/sess/"):
        path = "/" + path[6:].partition("/")[2]
    if path == _MESSAGES_PATH or path.startswith(_MESSAGES_PATH + "/"):
        return ANTHROPIC
    return OPENAI


class RequestRejected(Exception):
    """A request the proxy refuses before forwarding it."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def error_json(status: int, message: str, code: str | None, type_: str | None = None, shape: str = OPENAI) -> bytes:
    """The error's body in `shape`. `type_` overrides the OpenAI type of `status`; an
    Anthropic error takes Anthropic's type of `status` (its clients dispatch on those)."""
    if shape == ANTHROPIC:
        return orjson.dumps(anthropic_error(message, anthropic_type(status), code))
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
    """Answer with an error through a `proxy.http_server.Responder`, in its `error_shape`."""
    body = error_json(status, message, code, type_, getattr(responder, "error_shape", OPENAI))
    responder.send(status, body, [JSON_CONTENT_TYPE, *headers], close=close)


def sse_error_event(message: str, code: str, anthropic: bool = False) -> bytes:
    """The event that ends a stream whose upstream broke after the headers went out.

    OpenAI clients read `data: {"error": ...}`; Anthropic clients dispatch on the
    `event:` line and expect `{"type": "error", "error": {...}}`, so that route gets both.
    """
    if anthropic:
        return b"event: error\ndata: " + orjson.dumps(anthropic_error(message, "api_error", code)) + b"\n\n"
    return b"data: " + orjson.dumps(openai_error(message, "upstream_error", code)) + b"\n\n"
