"""Which session a request belongs to (docs/reference.md, The session of a request), as pure functions.

First match wins: the `/sess/{id}` path, the configured headers in order (kvgate's own
`session.header`, then `session.client_headers`: the headers agent clients send their
session in by themselves), then the configured body fields in order (dotted paths such
as `metadata.session_id` walk nested objects). Empty values count as absent. A value of
a body field the proxy reads that is not a string is rejected (400), never coerced.

JSON-encoded values: a string field whose value is a JSON object with a non-empty
string `session_id` names that session (Claude Code >= 2.1.78 sends
`metadata.user_id = '{"device_id": ..., "account_uuid": ..., "session_id": ...}'`;
the device and account parts are the same for every session of a user, so only
`session_id` identifies one). Any other string is the id as it is (older Claude
Code sends `user_<hash>_account_<uuid>_session_<uuid>`, unique per session).

Long ids: an id longer than MAX_SESSION_ID_BYTES (UTF-8) is replaced by its SHA-256
hex digest for routing, gating and the `session_id` forwarded upstream: the rule is
the gate's `gate.session_key.session_key`, applied here once per request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from kvgate.gate.session_key import session_key
from kvgate.proxy.errors import RequestRejected


def split_body_fields(fields: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """Pre-split dotted field paths once, at start-up."""
    return tuple(tuple(f.split(".")) for f in fields)


def bounded_session_id(raw: str) -> str:
    """The id used internally: `session_key(raw)` (itself, or its sha256 hex when longer
    than the limit). An id that is not UTF-8 text (a header's bytes decoded with
    surrogateescape) is a 400."""
    try:
        return session_key(raw)
    except UnicodeEncodeError:
        raise RequestRejected(400, "session id is not valid UTF-8; send UTF-8 text", "invalid_session_id") from None


def _body_value(body: dict, path: tuple[str, ...]) -> Any:
    """The value at `path` (a dotted body field, split), or None where any level is missing
    or is not an object."""
    node: Any = body
    for key in path[:-1]:
        node = node.get(key)
        if not isinstance(node, dict):
            return None
    return node.get(path[-1])


def embedded_session_id(value: str) -> str:
    """The `session_id` of a JSON-object string (see module doc), else `value` itself."""
    if not value.startswith("{"):
        return value
    try:
        decoded = orjson.loads(value)
    except orjson.JSONDecodeError:
        return value
    if isinstance(decoded, dict):
        inner = decoded.get("session_id")
        if isinstance(inner, str) and inner:
            return inner
    return value


def session_id_from_body(body: dict, fields: tuple[tuple[str, ...], ...]) -> str | None:
    for path in fields:
        value = _body_value(body, path)
        if value is None:
            continue
        if not isinstance(value, str):
            raise RequestRejected(
                400, f"field '{'.'.join(path)}' must be a string session id, got {type(value).__name__}", "invalid_type"
            )
        if value:
            return embedded_session_id(value)
    return None


def resolve_session_id(
    path_id: str | None,
    headers: Mapping[str, str],
    header_names: str | tuple[str, ...],
    body: dict | None,
    fields: tuple[tuple[str, ...], ...],
) -> str | None:
    """The session id of a request (bounded, see module doc), or None for anonymous.
    `header_names`: lower-case header names, tried in order (one name: just that one)."""
    if path_id is not None:
        if not path_id:
            raise RequestRejected(
                400,
                "empty session id in the /sess/{session_id}/ path; put the id between /sess/ and /v1",
                "invalid_session_id",
            )
        return bounded_session_id(path_id)
    for name in (header_names,) if isinstance(header_names, str) else header_names:
        value = headers.get(name)
        if value:
            return bounded_session_id(value)
    if body:
        found = session_id_from_body(body, fields)
        if found is not None:
            return bounded_session_id(found)
    return None
