"""The access log (`log.access: true`): one logfmt line per forwarded request.

    time=2026-12-01T21:40:01.123Z route=chat session=3f2a9c1d5e7b8a90 replica=r0 \
    admission=window_fits wait_ms=12.3 status=200 duration_ms=834.1      (one line)

Fields, always in this order: `time` (UTC, ISO 8601, when the request ended), `route`
(the route kind: chat, completion, messages, responses, models, passthrough), `session`
(the first 16 hex digits of the SHA-256 of the session id, so a log never holds an id;
`-` when anonymous), `replica` (`-` when none was chosen), `admission` (the gate's reason,
or the refusal's error code; `-` when the gate was not asked), `wait_ms` (held at the
gate), `status` (the answer's status; 499 when the client went away first) and
`duration_ms` (arrival to the end of the answer). Values never contain spaces or quotes,
so any logfmt reader (Loki, Vector, `grep`) splits them.

The lines go to the `kvgate.access` logger; `kvgate serve` writes it to stderr, message
only.
"""

from __future__ import annotations

import hashlib
import logging
import time

LOGGER = "kvgate.access"
FIELDS = ("time", "route", "session", "replica", "admission", "wait_ms", "status", "duration_ms")


def session_hash(session_id: str | None) -> str:
    """What the log shows of a session: its id's SHA-256, 16 hex digits (`-`: anonymous)."""
    if session_id is None:
        return "-"
    return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def access_line(
    ended_at: float,
    route: str,
    session_id: str | None,
    replica: str | None,
    admission: str | None,
    wait_ms: float,
    status: int,
    duration_sec: float,
) -> str:
    """One request's logfmt line (pure: `ended_at` is a Unix time)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ended_at)) + f".{int(ended_at * 1000) % 1000:03d}Z"
    values = (
        stamp,
        route,
        session_hash(session_id),
        replica or "-",
        admission or "-",
        f"{wait_ms:.1f}",
        str(status),
        f"{duration_sec * 1000:.1f}",
    )
    return " ".join(f"{name}={value}" for name, value in zip(FIELDS, values))


def configure_access_log(stream) -> logging.Logger:
    """`kvgate.access` writes bare lines to `stream` and nowhere else (`kvgate serve`)."""
    logger = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger
