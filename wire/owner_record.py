"""The replica's owner record: which kvgate enforces admission on a server.

A gate's books (windows, footprints, waiters) describe one replica's cache only while
that gate is the only one enforcing on it (docs/decisions/one-gate-per-replica.md). The
server keeps a tiny lease so that a second enforcing gate is detected instead of
silently over-admitting:

    POST OWNER_PATH OwnerClaim {"gate_id": "...", "ttl_sec": 15, "nonce"?: "..."}
         claim, renew (with the nonce) or release (ttl_sec 0, with the nonce)
    GET  OWNER_PATH  read
    -> OwnerAnswer {"version": 1, "held": bool, "owned": bool, "expires_in_sec": 12.5,
                    "contenders": 1, "nonce"?: "..."}

The messages (`OwnerClaim`, `OwnerAnswer`) build and parse here for both sides; the record
itself (`OwnerRecord`, `claim`, `answer`, and `OwnerBook`, its stateful shell) is the
server's, shared by the vLLM plugin and the simulated replica. The record belongs to the
gate that holds it (docs/security.md). Invariants (each has a table test in
tests/gate/test_ownership.py):

- at most one owner at a time; its lease lasts `ttl_sec` from its last claim;
- a claim that takes a free or lapsed record is answered with a fresh random nonce, which
  only that answer carries; the owner renews and releases with it (`ttl_sec: 0` releases
  at once, a gate stopping cleanly). A claim without it, even under the owner's gate id,
  is another gate's: naming the owner releases nothing;
- no answer names the owner: a read says whether the record is held and for how long;
- a claim by another gate while the lease is live is refused (`held: false`) and that gate
  counts among the `contenders` for its own `ttl_sec`, so the owner learns of the
  conflict on its next renewal too; at most MAX_CONTENDERS are kept, and answers carry
  their number, never their ids, so no caller can make the record or an answer grow;
- `ttl_sec: 0` from anyone but the owner only withdraws that gate from the contenders.

Gates make their ids unique per process (`ownership.gate_id` plus an instance suffix), so
two gates configured with one id are still two gates here. The clock and the nonce
source are passed in: monotonic seconds of the server, `secrets.token_urlsafe`.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.wire.probe_api import PROBE_API_VERSION
from kvgate.wire.routes import REPLICA_API_PREFIX

OWNER_PATH = REPLICA_API_PREFIX + "owner"
MAX_GATE_ID_CHARS = 256
MAX_TTL_SEC = 3600.0
MAX_NONCE_CHARS = 128
MAX_CONTENDERS = 16


class OwnerClaimError(ValueError):
    """A bad claim body; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class OwnerClaim:
    """A gate's claim (or renewal) of the record for `ttl_sec` seconds; 0 releases it.
    `nonce`: the one the record's answer gave this gate when it took it (renewal, release)."""

    gate_id: str
    ttl_sec: float
    nonce: str | None = None

    def to_json(self) -> dict:
        body: dict = {"gate_id": self.gate_id, "ttl_sec": self.ttl_sec}
        if self.nonce is not None:
            body["nonce"] = self.nonce
        return body

    @classmethod
    def parse(cls, body: object) -> OwnerClaim:
        """The claim in `body`, or OwnerClaimError naming the field."""
        if not isinstance(body, dict):
            raise OwnerClaimError('the owner claim must be a JSON object {"gate_id": str, "ttl_sec": number}')
        gate_id = body.get("gate_id")
        if not isinstance(gate_id, str) or not gate_id or len(gate_id) > MAX_GATE_ID_CHARS:
            raise OwnerClaimError(
                f"'gate_id' must be a non-empty string of at most {MAX_GATE_ID_CHARS} characters", "gate_id"
            )
        ttl = body.get("ttl_sec")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl <= MAX_TTL_SEC:
            raise OwnerClaimError(f"'ttl_sec' must be a number in [0, {MAX_TTL_SEC:g}] (0 releases)", "ttl_sec")
        nonce = body.get("nonce")
        if nonce is not None and (not isinstance(nonce, str) or not nonce or len(nonce) > MAX_NONCE_CHARS):
            raise OwnerClaimError(f"'nonce' must be a string of 1-{MAX_NONCE_CHARS} characters", "nonce")
        return cls(gate_id, float(ttl), nonce)


@dataclass(frozen=True)
class OwnerAnswer:
    """The record as one gate sees it: whether that gate holds it (and then its nonce),
    whether anyone does and for how long, and how many other gates contend for it."""

    held: bool
    owned: bool
    expires_in_sec: float
    contenders: int = 0
    nonce: str | None = None
    version: int = PROBE_API_VERSION

    def to_json(self) -> dict:
        out: dict = {
            "version": self.version,
            "held": self.held,
            "owned": self.owned,
            "expires_in_sec": self.expires_in_sec,
            "contenders": self.contenders,
        }
        if self.nonce is not None:
            out["nonce"] = self.nonce
        return out

    @classmethod
    def parse(cls, data: object) -> OwnerAnswer:
        """The answer in `data`; ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError("the owner answer is not a JSON object")
        held, owned, expires = data.get("held"), data.get("owned"), data.get("expires_in_sec", 0.0)
        contenders, nonce, version = (
            data.get("contenders", 0),
            data.get("nonce"),
            data.get("version", PROBE_API_VERSION),
        )
        if not isinstance(held, bool):
            raise ValueError("'held' must be a boolean")
        if not isinstance(owned, bool):
            raise ValueError("'owned' must be a boolean")
        if isinstance(expires, bool) or not isinstance(expires, (int, float)):
            raise ValueError("'expires_in_sec' must be a number")
        if isinstance(contenders, bool) or not isinstance(contenders, int) or contenders < 0:
            raise ValueError("'contenders' must be a non-negative integer")
        if nonce is not None and (not isinstance(nonce, str) or not nonce or len(nonce) > MAX_NONCE_CHARS):
            raise ValueError(f"'nonce' must be a string of 1-{MAX_NONCE_CHARS} characters")
        if held and nonce is None:
            raise ValueError("a held record's answer carries its nonce")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError("'version' must be an integer")
        return cls(held, owned, float(expires), contenders, nonce, version)


@dataclass
class OwnerRecord:
    owner: str | None = None
    nonce: str | None = None  # the owner's; only the answer that granted the record carries it
    expires_at: float = float("-inf")
    contenders: dict[str, float] = field(default_factory=dict)  # gate id -> until, at most MAX_CONTENDERS


def _live(record: OwnerRecord, now: float) -> OwnerRecord:
    """The record with a lapsed owner and lapsed contenders dropped."""
    if record.expires_at > now:
        owner, nonce, expires = record.owner, record.nonce, record.expires_at
    else:
        owner, nonce, expires = None, None, float("-inf")
    contenders = {g: until for g, until in record.contenders.items() if until > now}
    return OwnerRecord(owner, nonce, expires, contenders)


def _holds(record: OwnerRecord, gate_id: str, nonce: str | None) -> bool:
    """Whether a claim by `gate_id` showing `nonce` is the live owner's (nonce compared in
    constant time)."""
    if record.owner != gate_id or record.nonce is None or nonce is None:
        return False
    return hmac.compare_digest(nonce.encode(), record.nonce.encode())


def claim(
    record: OwnerRecord,
    gate_id: str,
    ttl_sec: float,
    now: float,
    nonce: str | None = None,
    new_nonce: Callable[[], str] = lambda: secrets.token_urlsafe(24),
) -> tuple[OwnerRecord, bool]:
    """(the record, whether the claimer holds it) after `gate_id`, showing `nonce`, claims,
    renews, or with ttl 0 releases, at `now`."""
    live = _live(record, now)
    if live.owner is not None and _holds(live, gate_id, nonce):
        if ttl_sec == 0:
            return OwnerRecord(None, None, float("-inf"), live.contenders), False
        return OwnerRecord(live.owner, live.nonce, now + ttl_sec, live.contenders), True
    if ttl_sec == 0:
        live.contenders.pop(gate_id, None)
        return live, False
    if live.owner is None:
        live.contenders.pop(gate_id, None)
        return OwnerRecord(gate_id, new_nonce(), now + ttl_sec, live.contenders), True
    if gate_id in live.contenders or len(live.contenders) < MAX_CONTENDERS:
        live.contenders[gate_id] = now + ttl_sec
    return live, False


def answer(record: OwnerRecord, now: float, held: bool = False) -> OwnerAnswer:
    """The answer to a claim that holds the record (`held`: with its nonce) or to anyone else
    (a refused claim, a plain read): never the owner's id, and the contenders as a count."""
    live = _live(record, now)
    return OwnerAnswer(
        held=held,
        owned=live.owner is not None,
        expires_in_sec=round(live.expires_at - now, 3) if live.owner is not None else 0.0,
        contenders=len(live.contenders),
        nonce=live.nonce if held else None,
    )


class OwnerBook:
    """The server's one record, behind a clock: the stateful shell both servers use."""

    def __init__(self, clock: Callable[[], float], new_nonce: Callable[[], str] = lambda: secrets.token_urlsafe(24)):
        self._clock = clock
        self._new_nonce = new_nonce
        self.record = OwnerRecord()

    def claim(self, body: object) -> dict:
        """Apply the claim in `body` (OwnerClaimError if it is not one); the answer's JSON."""
        request = OwnerClaim.parse(body)
        now = self._clock()
        self.record, held = claim(self.record, request.gate_id, request.ttl_sec, now, request.nonce, self._new_nonce)
        return answer(self.record, now, held).to_json()

    def read(self) -> dict:
        return answer(self.record, self._clock()).to_json()
