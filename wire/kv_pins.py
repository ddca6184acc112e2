"""KV pins: a gate asks a replica to keep a session's window resident between its turns.

A turn's request body names its pin in vLLM's own `kv_transfer_params` field:

    {"kv_transfer_params": {"kvgate_pin": {"session": "<id>", "ttl_sec": 30, "proof": "<hex>"}}, ...}

and the gate ends pins with `POST RELEASE_PATH` (`ReleaseQuery` -> `ReleaseAnswer`). The
kv answer (`probe_api.KvAnswer`) reports `num_pinned_blocks`, `num_pinned_sessions` and
`num_pin_yields`. Two servers keep pins: the vLLM plugin's retention connector and the
simulated replica; `tests/pin_sequence.py` is the one scripted sequence both must pass.

Semantics, the same in both servers (invariants):

- When a turn with a valid pin finishes, its session's pin becomes that turn's full,
  prefix-cached blocks (the blocks a next turn of the session can hit); the session's
  previous pin, if any, is released in the same step. A turn that finishes with no
  full cached block (aborted before its prefill) leaves the session's pin as it was. A
  session holds at most one pin.
- A pinned block holds a reference: it is neither free nor evictable, so it counts in
  `num_total_blocks - num_free_blocks` and in `kv_cache_usage`.
- A pin ends at the first of: a release naming its session; `ttl_sec` after its turn
  finished (at most the server's cap); the engine cannot otherwise fit a request it
  schedules (running or waiting). Then the engine releases pins, the least recently
  pinned first, until the request fits, and counts each such release in `num_pin_yields`.
  So a pin never causes a preemption nor keeps a request waiting: pinned blocks are
  only ever evicted after every unpinned cached block.
- A pin is valid only with the proof of the replica key: `proof == pin_proof(key,
  session)`. A server without a replica key (an open replica API) accepts any proof. A
  body with an invalid pin is served as if it had none; kvgate strips `kvgate_pin` from
  clients' bodies, so only gates pin.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass

from kvgate.wire.routes import REPLICA_API_PREFIX

RELEASE_PATH = REPLICA_API_PREFIX + "release"
TRANSFER_PARAMS_FIELD = "kv_transfer_params"  # vLLM's request field the pin travels in
PIN_KEY = "kvgate_pin"
MAX_PIN_TTL_SEC = 600.0  # a server's default cap on a pin's ttl_sec
MAX_SESSION_CHARS = 256


class PinError(ValueError):
    """A pin or release a server cannot take; the message names the field."""


def pin_proof(replica_key: str | None, session: str) -> str:
    """The proof a gate sends with a pin: HMAC-SHA256 of the session under the replica key
    (hex); "" for a replica without a key."""
    if not replica_key:
        return ""
    return hmac.new(replica_key.encode(), session.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Pin:
    """One turn's pin request: keep `session`'s window for `ttl_sec` after the turn ends."""

    session: str
    ttl_sec: float
    proof: str = ""

    def to_json(self) -> dict:
        return {"session": self.session, "ttl_sec": self.ttl_sec, "proof": self.proof}

    @classmethod
    def parse(cls, doc: object) -> Pin:
        if not isinstance(doc, dict):
            raise PinError(f"{PIN_KEY} must be a JSON object")
        session, ttl, proof = doc.get("session"), doc.get("ttl_sec"), doc.get("proof", "")
        if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS:
            raise PinError(f"{PIN_KEY}.session must be a string of 1 to {MAX_SESSION_CHARS} characters")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
            raise PinError(f"{PIN_KEY}.ttl_sec must be a positive number of seconds")
        if not isinstance(proof, str):
            raise PinError(f"{PIN_KEY}.proof must be a string")
        return cls(session, float(ttl), proof)

    def valid_for(self, replica_key: str | None) -> bool:
        """Whether a server whose replica key is `replica_key` (None: open) keeps this pin."""
        if not replica_key:
            return True
        return hmac.compare_digest(self.proof.encode(), pin_proof(replica_key, self.session).encode())


def make_pin(session: str, ttl_sec: float, replica_key: str | None) -> Pin:
    """The pin a gate holding `replica_key` sends for `session`."""
    return Pin(session, float(ttl_sec), pin_proof(replica_key, session))


def with_pin(body: dict, pin: Pin) -> dict:
    """`body` (a turn's request body, not modified) with `pin` in its kv_transfer_params,
    keeping any other transfer parameters."""
    params = body.get(TRANSFER_PARAMS_FIELD)
    params = dict(params) if isinstance(params, dict) else {}
    params[PIN_KEY] = pin.to_json()
    return {**body, TRANSFER_PARAMS_FIELD: params}


def without_pin(body: dict) -> dict:
    """`body` with any `kvgate_pin` removed (a client's body: only gates pin); `body` itself
    when it names none."""
    params = body.get(TRANSFER_PARAMS_FIELD)
    if not isinstance(params, dict) or PIN_KEY not in params:
        return body
    rest = {key: value for key, value in params.items() if key != PIN_KEY}
    stripped = {key: value for key, value in body.items() if key != TRANSFER_PARAMS_FIELD}
    if rest:
        stripped[TRANSFER_PARAMS_FIELD] = rest
    return stripped


def pin_of(transfer_params: object) -> Pin | None:
    """The pin a request's `kv_transfer_params` names, None when it names none; PinError
    when it names a malformed one."""
    if not isinstance(transfer_params, dict) or PIN_KEY not in transfer_params:
        return None
    return Pin.parse(transfer_params[PIN_KEY])


@dataclass(frozen=True, slots=True)
class ReleaseQuery:
    """`POST RELEASE_PATH`'s body: `{"sessions": ["<id>", ...]}`; releasing a session that holds
    no pin is not an error (its pin may have expired or yielded)."""

    sessions: tuple[str, ...]

    def to_json(self) -> dict:
        return {"sessions": list(self.sessions)}

    @classmethod
    def parse(cls, doc: object) -> ReleaseQuery:
        if not isinstance(doc, dict) or not isinstance(doc.get("sessions"), list):
            raise PinError("the release body must be a JSON object with 'sessions': a list of session ids")
        sessions = doc["sessions"]
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_SESSION_CHARS for s in sessions):
            raise PinError(f"'sessions' must hold strings of 1 to {MAX_SESSION_CHARS} characters")
        return cls(tuple(sessions))


@dataclass(frozen=True, slots=True)
class ReleaseAnswer:
    """What a release freed: sessions that held a pin, and their blocks (now evictable)."""

    released_sessions: int
    released_blocks: int

    def to_json(self) -> dict:
        return {"released_sessions": self.released_sessions, "released_blocks": self.released_blocks}

    @classmethod
    def parse(cls, doc: object) -> ReleaseAnswer:
        if not isinstance(doc, dict):
            raise PinError("the release answer must be a JSON object")
        sessions, blocks = doc.get("released_sessions"), doc.get("released_blocks")
        if not (type(sessions) is int and type(blocks) is int and sessions >= 0 and blocks >= 0):
            raise PinError("released_sessions and released_blocks must be non-negative integers")
        return cls(sessions, blocks)
