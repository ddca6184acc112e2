"""The one bound on session ids (docs/reference.md, The session of a request): an id longer than 512 bytes of UTF-8
is replaced by its SHA-256 hex digest, everywhere (routing, gate, admin, the `session_id`
sent upstream).

The proxy applies it when it resolves a request's session id (`proxy.session_id`, which
turns an id that is not UTF-8 text into a 400); the gates apply it again to whatever they
are given (`AdmissionController`), so the books stay bounded for every caller. It is
idempotent (a digest is 64 characters), so an id the proxy bounded is booked, shown in
/admin/state and finished under the same key. Hashing rather than rejecting keeps clients
working whose ids embed long tokens; the digest is stable, so stickiness is unaffected.
"""

from __future__ import annotations

from hashlib import sha256

MAX_SESSION_ID_BYTES = 512


def session_key(session_id: str) -> str:
    """The id itself, or its SHA-256 hex digest when its UTF-8 is longer than
    MAX_SESSION_ID_BYTES. UnicodeEncodeError when it is not UTF-8 text (a lone surrogate)."""
    if session_id.isascii():  # fast path: one byte per character
        if len(session_id) <= MAX_SESSION_ID_BYTES:
            return session_id
        return sha256(session_id.encode("ascii")).hexdigest()
    encoded = session_id.encode("utf-8")
    return session_id if len(encoded) <= MAX_SESSION_ID_BYTES else sha256(encoded).hexdigest()
