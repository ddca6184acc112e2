"""The one bound on session ids (docs/reference.md, `gate.session_key`): over 512 bytes
of UTF-8, the SHA-256 hex digest; the proxy and the gates apply the same function."""

from __future__ import annotations

from hashlib import sha256

import pytest

from kvgate.gate.session_key import MAX_SESSION_ID_BYTES, session_key


def digest(text: str) -> str:
    return sha256(text.encode("utf-8")).hexdigest()


@pytest.mark.parametrize(
    "session_id, hashed",
    [
        ("a" * MAX_SESSION_ID_BYTES, False),  # 512 bytes: kept
        ("a" * (MAX_SESSION_ID_BYTES + 1), True),  # 513 bytes
        ("a" * 300, False),  # over the gate's former 256-character bound: kept now
        ("é" * (MAX_SESSION_ID_BYTES // 2), False),  # 256 characters of 2 bytes: 512 bytes
        ("é" * (MAX_SESSION_ID_BYTES // 2 + 1), True),  # 257 characters, 514 bytes
        ("€" * 170 + "ab", False),  # 3-byte characters: 512 bytes
        ("€" * 170 + "abc", True),  # 513 bytes in 173 characters
        ("", False),
    ],
)
def test_ids_over_512_utf8_bytes_become_their_sha256_hex(session_id, hashed):
    assert session_key(session_id) == (digest(session_id) if hashed else session_id)


@pytest.mark.parametrize("session_id", ["s1", "x" * 10_240, "é" * 400])
def test_the_bound_is_idempotent(session_id):
    """An id the proxy already bounded is booked by the gate under the same key."""
    key = session_key(session_id)
    assert session_key(key) == key and len(key.encode()) <= MAX_SESSION_ID_BYTES


def test_an_id_that_is_not_utf8_text_raises():
    with pytest.raises(UnicodeEncodeError):
        session_key("bad\udcff")
