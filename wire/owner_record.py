"""The replica's owner record: which kvgate enforces admission on a server.

A gate's books (windows, footprints, waiters) describe one replica's cache only while
that gate is the only one enforcing on it (docs/decisions/one-gate-per-replica.md). The
server keeps a tiny lease so that a second enforcing gate is detected instead of
silently over-admitting:

    POST OWNER_PATH OwnerClaim {"gate_id": "...", "ttl_sec": 15}   claim or renew (ttl_sec 0: release)
    GET  OWNER_PATH                                                read
    -> OwnerAnswer {"version": 1, "owner": "gate-a" | null, "held": bool,
                    "expires_in_sec": 12.5, "contenders": ["gate-b"]}

The messages (`OwnerClaim`, `OwnerAnswer`) build and parse here for both sides; the record
itself (`OwnerRecord`, `claim`, `answer`, and `OwnerBook`, its stateful shell) is the
server's, shared by the vLLM plugin and the simulated replica. Invariants (each has a
table test in tests/gate/test_ownership.py):

- at most one owner at a time; its lease lasts `ttl_sec` from its last claim;
- the owner renews by claiming again; anyone takes a free or lapsed record;
- a claim by another gate while the lease is live is refused (`held: false`, the owner
  named) and that gate is listed in `contenders` for its own `ttl_sec`, so the owner
  learns of the conflict on its next renewal too;
- `ttl_sec: 0` from the owner releases the record at once (a gate stopping cleanly), from
  anyone else it only withdraws that gate from `contenders`.

The clock is passed in: monotonic seconds of the server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.wire.probe_api import PROBE_API_VERSION
from kvgate.wire.routes import REPLICA_API_PREFIX

OWNER_PATH = REPLICA_API_PREFIX + "owner"
MAX_GATE_ID_CHARS = 256
MAX_TTL_SEC = 3600.0


class OwnerClaimError(ValueError):
    """A bad claim body; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class OwnerClaim:
    """A gate's claim (or renewal) of the record for `ttl_sec` seconds; 0 releases it."""

    gate_id: str
    ttl_sec: float

    def to_json(self) -> dict:
        return {"gate_id": self.gate_id, "ttl_sec": self.ttl_sec}

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
        return cls(gate_id, float(ttl))


@dataclass(frozen=True)
class OwnerAnswer:
    """The record as one gate sees it: the owner, whether that gate holds it, the lease left,
    the other gates contending for it."""

    owner: str | None
    held: bool
    expires_in_sec: float
    contenders: tuple[str, ...] = ()
    version: int = PROBE_API_VERSION

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "owner": self.owner,
            "held": self.held,
            "expires_in_sec": self.expires_in_sec,
            "contenders": list(self.contenders),
        }

    @classmethod
    def parse(cls, data: object) -> OwnerAnswer:
        """The answer in `data`; ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError("the owner answer is not a JSON object")
        owner, held, expires = data.get("owner"), data.get("held"), data.get("expires_in_sec", 0.0)
        contenders, version = data.get("contenders", []), data.get("version", PROBE_API_VERSION)
        if owner is not None and not isinstance(owner, str):
            raise ValueError("'owner' must be a string or null")
        if not isinstance(held, bool):
            raise ValueError("'held' must be a boolean")
        if isinstance(expires, bool) or not isinstance(expires, (int, float)):
            raise ValueError("'expires_in_sec' must be a number")
        if not isinstance(contenders, list) or not all(isinstance(c, str) for c in contenders):
            raise ValueError("'contenders' must be a list of strings")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError("'version' must be an integer")
        return cls(owner, held, float(expires), tuple(contenders), version)


@dataclass
class OwnerRecord:
    owner: str | None = None
    expires_at: float = float("-inf")
    contenders: dict[str, float] = field(default_factory=dict)  # gate id -> until


def _live(record: OwnerRecord, now: float) -> OwnerRecord:
    """The record with a lapsed owner and lapsed contenders dropped."""
    owner, expires = (record.owner, record.expires_at) if record.expires_at > now else (None, float("-inf"))
    contenders = {g: until for g, until in record.contenders.items() if until > now and g != owner}
    return OwnerRecord(owner, expires, contenders)


def claim(record: OwnerRecord, gate_id: str, ttl_sec: float, now: float) -> OwnerRecord:
    """The record after `gate_id` claims (or renews, or with ttl 0 releases) at `now`."""
    live = _live(record, now)
    if ttl_sec == 0:
        if live.owner == gate_id:
            return OwnerRecord(None, float("-inf"), live.contenders)
        live.contenders.pop(gate_id, None)
        return live
    if live.owner is None or live.owner == gate_id:
        live.contenders.pop(gate_id, None)
        return OwnerRecord(gate_id, now + ttl_sec, live.contenders)
    live.contenders[gate_id] = now + ttl_sec
    return live


def answer(record: OwnerRecord, gate_id: str | None, now: float) -> OwnerAnswer:
    """The answer for `gate_id` (None: a plain read)."""
    live = _live(record, now)
    return OwnerAnswer(
        owner=live.owner,
        held=live.owner is not None and live.owner == gate_id,
        expires_in_sec=round(live.expires_at - now, 3) if live.owner is not None else 0.0,
        contenders=tuple(sorted(live.contenders)),
    )


class OwnerBook:
    """The server's one record, behind a clock: the stateful shell both servers use."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.record = OwnerRecord()

    def claim(self, body: object) -> dict:
        """Apply the claim in `body` (OwnerClaimError if it is not one); the answer's JSON."""
        request = OwnerClaim.parse(body)
        now = self._clock()
        self.record = claim(self.record, request.gate_id, request.ttl_sec, now)
        return answer(self.record, request.gate_id, now).to_json()

    def read(self) -> dict:
        return answer(self.record, None, self._clock()).to_json()
