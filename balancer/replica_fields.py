"""What may name a replica and what may be its URL, as pure functions (RFC 9110 5.1, 5.5).

A replica's name goes into `x-kvgate-replica` on every answer and into the admin API's
paths; its URL's host and path go into the upstream request line and Host header. Both
come from the config and the admin API (`ReplicaRegistry.add`), so they are checked
where they enter: a name with CRLF would otherwise become a header line of its own on
every answer. The config loader (`kvgate.proxy.config`) checks `replicas[]` with the
same functions.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

MAX_REPLICA_NAME = 128
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_URL_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII, no space


def is_token(text: str) -> bool:
    """An RFC 9110 token: a valid header name (and a valid replica name)."""
    return bool(_TOKEN.fullmatch(text))


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


def replica_url_key(url: str) -> str:
    """What makes two replica URLs the same server: scheme and host in lower case, the
    port spelled out (80 / 443 when absent), no trailing slash. Call it on URLs that
    `replica_url_problem` accepts."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return f"{scheme}://{(parts.hostname or '').lower()}:{port}{parts.path.rstrip('/')}"
