"""Parsing and checking a request body, as pure functions.

Invariant: the body is parsed exactly once (orjson) and the fields the proxy reads
(`stream` here, the session fields in `proxy.session_id`) are type-checked before
anything is forwarded, so upstreams never see a request the proxy misread.
"""

from __future__ import annotations

import orjson

from kvgate.proxy.errors import RequestRejected
from kvgate.wire.kv_pins import PIN_KEY, TRANSFER_PARAMS_FIELD, Pin, with_pin, without_pin


def parse_json_object(raw: bytes) -> dict:
    """The request body as a dict, or RequestRejected(400) saying what is wrong."""
    if not raw or raw.isspace():
        raise RequestRejected(400, "request body is empty; send a JSON object", "invalid_body")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestRejected(
            400, f"request body is not valid JSON ({exc}); send a JSON object", "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise RequestRejected(
            400, f"request body must be a JSON object, got a JSON {type(body).__name__}", "invalid_body"
        )
    return body


def stream_flag(body: dict) -> bool:
    """The `stream` field: absent or null means False; anything but a bool is rejected."""
    value = body.get("stream")
    if value is None:
        return False
    if value is True or value is False:
        return value
    raise RequestRejected(400, f"field 'stream' must be a boolean, got {type(value).__name__}", "invalid_type")


def with_member(raw: bytes, body: dict, name: str, value: object) -> bytes:
    """`raw` (the bytes `body` was parsed from) with `"<name>": <value>` spliced in as
    its first member: the client's bytes are kept as sent (big integers, number
    spelling, duplicate keys, key order), and nothing is encoded twice. The caller
    adds the member only when `body` lacks it, so the splice never duplicates a key."""
    start = raw.index(b"{") + 1  # a JSON object: only whitespace comes before its brace
    member = orjson.dumps(name) + b":" + orjson.dumps(value)
    return b"".join((raw[:start], member, b"," if body else b"", raw[start:]))


def with_priority(raw: bytes, body: dict, priority: int) -> bytes:
    """`raw` forwarded at vLLM `priority` (lower is served first): spliced in when the body
    has none; a body with its own integer priority keeps the later of the two (re-encoded,
    the one case the client's bytes are not kept); any other value is left for vLLM to judge."""
    own = body.get("priority")
    if own is None and "priority" not in body:
        return with_member(raw, body, "priority", priority)
    if type(own) is not int or own >= priority:
        return raw
    return orjson.dumps({**body, "priority": priority})


def without_kv_pin(raw: bytes, body: dict) -> tuple[bytes, dict]:
    """A client's body and its parsed form without `kv_transfer_params.kvgate_pin`: only
    gates pin (`kvgate.wire.kv_pins`). As received when it names no pin, else re-encoded."""
    stripped = without_pin(body)
    if stripped is body:
        return raw, body
    return orjson.dumps(stripped), stripped


def with_kv_pin(raw: bytes, body: dict, pin: Pin) -> bytes:
    """`raw` (the bytes forwarded so far, parsed as `body`) with the gate's KV pin in its
    `kv_transfer_params`: spliced in when the body has none, else re-encoded with the
    client's other transfer parameters kept."""
    if TRANSFER_PARAMS_FIELD not in body:
        return with_member(raw, body, TRANSFER_PARAMS_FIELD, {PIN_KEY: pin.to_json()})
    return orjson.dumps(with_pin(orjson.loads(raw), pin))


def passthrough_body(raw: bytes | None) -> dict:
    """What kvgate reads of a body it relays ungated (kvgate.wire.routes.PASSTHROUGH): the JSON
    object, or {} for anything else (a multipart upload, an empty body, a JSON array).
    Never rejected here: the replica answers for its own routes."""
    if not raw or raw[:1] not in (b"{", b" ", b"\n", b"\r", b"\t"):
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}
