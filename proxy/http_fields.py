"""Checks on what kvgate writes into HTTP heads, as pure functions (RFC 9110 5.1, 5.5).

kvgate writes some values it did not parse from a request: replica names (in
`x-kvgate-replica` on every answer), replica URLs (their host and path go into the
upstream request line and Host header), the upstream API key (in Authorization).
They come from the config and the admin API, so they are checked where they enter:
a name with CRLF would otherwise become a header line of its own on every answer.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from kvgate.proxy.errors import RequestRejected

MAX_REPLICA_NAME = 128
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e]*")  # visible ASCII, space and tab: no CR, LF, NUL
_URL_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII, no space


def is_token(text: str) -> bool:
    """An RFC 9110 token: a valid header name."""
    return bool(_TOKEN.fullmatch(text))


def field_value_problem(text: str) -> str | None:
    if not _FIELD_VALUE.fullmatch(text):
        return "must be printable ASCII (no CR, LF, NUL or other control characters)"
    return None


def header_name_problem(text: str) -> str | None:
    if not is_token(text):
        return "must be an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)"
    return None


def replica_name_problem(name: str) -> str | None:
    """Why `name` cannot name a replica, or None. It goes into a response header and
    into the admin API's paths, so it must be an HTTP token."""
    if not name:
        return "must not be empty"
    if len(name) > MAX_REPLICA_NAME or not is_token(name):
        return (
            f"must be 1-{MAX_REPLICA_NAME} letters, digits or !#$%&'*+-.^_`|~ "
            "(it is sent in the x-kvgate-replica header)"
        )
    return None


def replica_url_problem(url: str) -> str | None:
    """Why `url` cannot be a replica's base URL, or None: http(s)://host[:port][/path],
    visible ASCII only, no user info, query or fragment."""
    if not _URL_CHARS.fullmatch(url):
        return "must be an http:// or https:// URL of visible ASCII characters (no spaces or control characters)"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    try:
        _ = parts.port  # urlsplit checks the port only when asked
    except ValueError:
        return "has an invalid port"
    if parts.username is not None or parts.query or parts.fragment or "#" in url or "?" in url:
        return "must not carry user info, a query or a fragment"
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
