"""Which request paths kvgate serves: canonical ones only, so that what kvgate routes,
authenticates and screens is byte for byte what a replica routes on.

kvgate never forwards the replica API (`/v1/kvgate/...`) for a client, and it routes
by path. A replica's server percent-decodes a path before routing it
(`/v1/%6bvgate/kv` is its `/v1/kvgate/kv`), and an intermediate may merge `//` or
resolve `.` and `..` segments, so a check on the raw bytes alone is bypassed. kvgate
refuses such paths (400 `non_canonical_path`) rather than rewriting them: a refused
path cannot mean one thing to kvgate and another to the replica, and no client needs
one (no route kvgate or vLLM serves has an escaped letter, an empty segment or a dot
segment in it).

A path is canonical when no segment is empty (a trailing `/` aside) or a dot segment,
every `%` starts a valid escape, and no escape hides an unreserved character (letters,
digits, `-._~`, RFC 3986 2.3, which a normaliser decodes) or a `/`. Escapes of other
characters (`%20`, `%3F`, UTF-8 bytes) stay legal and mean the same thing on both
sides. The session id segment of `/sess/{session_id}/...` is kvgate's own (decoded by
kvgate, never forwarded) and is not judged here.
"""

from __future__ import annotations

import re
import string

_ESCAPE = re.compile(r"%(.{0,2})", re.DOTALL)
_HEX = frozenset(string.hexdigits)
_NOT_ESCAPED = frozenset(string.ascii_letters + string.digits + "-._~/")
_DOT_SEGMENTS = frozenset({".", ".."})
SESSION_PREFIX = "/sess/"


def _segment_problem(segment: str) -> str | None:
    if segment == "":
        return "an empty segment ('//')"
    if segment in _DOT_SEGMENTS:
        return f"a dot segment ('{segment}')"
    if "%" not in segment:
        return None
    for match in _ESCAPE.finditer(segment):
        code = match.group(1)
        if len(code) != 2 or not set(code) <= _HEX:
            return f"a '%' that starts no escape ('%{code}')"
        if chr(int(code, 16)) in _NOT_ESCAPED:
            return f"an escaped '{chr(int(code, 16))}' ('%{code}')"
    return None


def path_problem(path: str) -> str | None:
    """Why `path` (the request target's path, as received) is not canonical, or None."""
    if not path.startswith("/") or path == "/":
        return None  # '/', '*' or an absolute form: no route matches it, kvgate answers 404
    segments = path[1:].split("/")
    if segments[-1] == "" and len(segments) > 1:
        segments.pop()  # a trailing '/' is a different path, not a disguised one
    if path.startswith(SESSION_PREFIX) and len(segments) >= 2:
        del segments[1]  # the session id: kvgate's, decoded by kvgate, never forwarded
    for segment in segments:
        problem = _segment_problem(segment)
        if problem is not None:
            return problem
    return None


def non_canonical_message(path: str, problem: str) -> str:
    shown = path if len(path) <= 200 else path[:200] + "..."
    return (
        f"the request path {shown!r} has {problem}; kvgate serves canonical paths only: send the "
        "route as written, without escaped letters, digits or '/', '//' or '.'/'..' segments"
    )
