"""Checks on what kvgate writes into HTTP heads, as pure functions (RFC 9110 5.1, 5.5).

kvgate writes some values it did not parse from a request: header names from the
config, the upstream API key (in Authorization), replica names and URLs. They come
from the config and the admin API, so they are checked where they enter. Replica
names and URLs are the balancer's (`balancer.replica_fields`, which also defines
the RFC 9110 token).
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from kvgate.balancer.replica_fields import is_token
from kvgate.proxy.errors import RequestRejected

_FIELD_VALUE = re.compile(r"[\t\x20-\x7e]*")  # visible ASCII, space and tab: no CR, LF, NUL


def field_value_problem(text: str) -> str | None:
    if not _FIELD_VALUE.fullmatch(text):
        return "must be printable ASCII (no CR, LF, NUL or other control characters)"
    return None


def header_name_problem(text: str) -> str | None:
    if not is_token(text):
        return "must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)"
    return None


def decode_path_segment(raw: str, what: str = "session id") -> str:
    """A percent-decoded path segment; 400 when it does not decode to UTF-8 text."""
    try:
        return unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise RequestRejected(
            400,
            f"the {what} in the path is not UTF-8 once percent-decoded; percent-encode its UTF-8 bytes",
            "invalid_session_id" if what == "session id" else "invalid_path",
        ) from None
