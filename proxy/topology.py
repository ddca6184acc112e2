"""Tiers of kvgate (docs/ARCHITECTURE.md, Topologies): what a `role` means, pure.

- `standalone`: one kvgate routes to its replicas and gates them (the default).
- `replica_gate`: runs beside exactly one vLLM server and gates it; its `/ready` is that
  server's health (and no ownership conflict).
- `front_door`: routes sessions (rendezvous hashing agrees across front doors that share
  a replica list and weights) to replica gates, with its own gate off: it never gates a
  second time. It health-checks the replica gates' `/ready` (their vLLM), forwards the
  resolved session id in the session header, and relays the replica gate's
  `x-kvgate-*` headers instead of writing its own.

Invariants: a config whose role and gate contradict each other is refused at load
(`role_problems`); the `x-kvgate-*` headers a client sees come from the innermost
kvgate that answered (`merge_kvgate_headers`).
"""

from __future__ import annotations

import hashlib

from kvgate.gate.probe import missing_probe_api
from kvgate.proxy.settings import Settings
from kvgate.wire.owner_record import OWNER_PATH

STANDALONE = "standalone"
FRONT_DOOR = "front_door"
REPLICA_GATE = "replica_gate"
ROLES = (STANDALONE, FRONT_DOOR, REPLICA_GATE)

KVGATE_HEADER_PREFIX = b"x-kvgate-"


def role_problems(settings: Settings) -> list[str]:
    """Combinations of role, replicas and gate that cannot be right; one line each, naming the key."""
    problems: list[str] = []
    role, mode, replicas = settings.role, settings.gate.mode, settings.replicas
    if role == FRONT_DOOR:
        if mode != "off":
            problems.append(
                f"gate.mode: role front_door forwards to replica gates that already gate their vLLM; a front "
                f"door must not gate a second time: set gate.mode: off (got {mode})"
            )
        if not replicas:
            problems.append(
                "replicas: role front_door needs the replica gates' URLs (with none, serve would start "
                "simulated replicas and gate nothing)"
            )
    elif role == REPLICA_GATE:
        if len(replicas) != 1:
            problems.append(
                f"replicas: role replica_gate runs beside one vLLM server and keeps that server's books: "
                f"configure exactly one replica (got {len(replicas)})"
            )
        if mode == "off":
            problems.append(
                "gate.mode: role replica_gate exists to gate its vLLM: set gate.mode: enforce or shadow "
                "(got off); a kvgate that only routes is role front_door"
            )
    return problems


def health_path(role: str) -> str:
    """The path a kvgate polls on its replicas: a front door asks replica gates whether their vLLM is up."""
    return "/ready" if role == FRONT_DOOR else "/health"


def claims_ownership(settings: Settings) -> bool:
    """Whether this kvgate claims its replicas' owner records: it enforces and detection is on.
    (A shadow gate holds nothing back, so it must not take the record from one that enforces.)"""
    return settings.gate.mode == "enforce" and settings.ownership.ttl_sec > 0


# The one header a front door names the session in for the replica gates behind it. Fixed,
# not `session.header`: two tiers configured with different session headers would lose
# every session silently. A replica gate reads it before its own `session.header`.
TIER_SESSION_HEADER = "x-kvgate-session-id"
_TIER_SESSION_HEADER_BYTES = TIER_SESSION_HEADER.encode()


def session_header_value(session_id: str) -> bytes:
    """The session id as a header value for the next tier: as is when it is visible ASCII,
    else `sha256:<hex>` (deterministic, so every front door sends the same key)."""
    if session_id.isascii() and session_id.isprintable():
        return session_id.encode()
    return b"sha256:" + hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest().encode()


def with_session_header(headers: list[tuple[bytes, bytes]], session_id: str | None) -> list[tuple[bytes, bytes]]:
    """`headers` with TIER_SESSION_HEADER set to the resolved session id (None: removed), replacing
    any the client sent (a `/sess/{id}` path outranks the header, and the next tier only sees
    headers and body)."""
    out = [(k, v) for k, v in headers if k.lower() != _TIER_SESSION_HEADER_BYTES]
    if session_id is not None:
        out.append((_TIER_SESSION_HEADER_BYTES, session_header_value(session_id)))
    return out


def merge_kvgate_headers(
    relayed: list[tuple[bytes, bytes]], own: list[tuple[bytes, bytes]]
) -> tuple[list[tuple[bytes, bytes]], bool]:
    """The response headers: the upstream's, plus each of this kvgate's own `x-kvgate-*` headers
    that the upstream did not send (a replica gate's admission reason and wait win over a front
    door's `open`). Returns (headers, whether the upstream is itself a kvgate)."""
    present = {k.lower() for k, _ in relayed if k[:9].lower() == KVGATE_HEADER_PREFIX}
    if not present:
        relayed.extend(own)
        return relayed, False
    relayed.extend(h for h in own if h[0] not in present)
    return relayed, True


# ---- check-config --contact-replicas: what a replica's answers say about the config (pure) ----


def replica_findings(
    settings: Settings,
    index: int,
    name: str,
    *,
    reachable: bool,
    is_kvgate: bool,
    owner_status: int | None,
    owner: dict | None,
    kv_status: int | None = 200,
    url: str = "",
    metrics_status: int | None = 200,
) -> tuple[list[str], list[str]]:
    """(problems, notes) for replica `index` from what it answered: `is_kvgate` (its /metrics has
    kvgate's metrics), `owner_status`/`owner` (GET /v1/kvgate/owner: status and JSON, None if unreached),
    `kv_status` (GET /v1/kvgate/kv: 404 is a vLLM without the plugin, 401 one that wants the
    replica key), `metrics_status` (GET /metrics: 401 is a replica gate that wants a client key)."""
    key = f"replicas[{index}] ({name})"
    if not reachable:
        return [f"{key}: unreachable, so this check could not look at it"], []
    if settings.role == FRONT_DOOR:
        return _front_door_problems(key, is_kvgate, metrics_status), []
    if settings.gate.mode == "off":
        return [], []
    return _gated_replica_findings(settings, key, name, url, is_kvgate, owner_status, owner, kv_status)


def _front_door_problems(key: str, is_kvgate: bool, metrics_status: int | None) -> list[str]:
    """A front door's replicas are replica gates: one that wants a client key, or is no kvgate."""
    if metrics_status == 401:
        return [
            f"{key}: answers 401: it asks for a client key; set upstream.api_key (or upstream.api_key_file) "
            "to one of its auth.api_keys (docs/security.md)"
        ]
    if not is_kvgate:
        return [
            f"{key}: is not a kvgate (no kvgate metrics on /metrics); a front door routes to "
            "replica gates (role: replica_gate beside each vLLM), or use role: standalone"
        ]
    return []


def _gated_replica_findings(
    settings: Settings,
    key: str,
    name: str,
    url: str,
    is_kvgate: bool,
    owner_status: int | None,
    owner: dict | None,
    kv_status: int | None,
) -> tuple[list[str], list[str]]:
    """(problems, notes) for a replica this kvgate gates: it must be a vLLM with the plugin,
    reachable with the replica key, that no other kvgate enforces on; the first finding wins."""
    if is_kvgate:
        return [
            f"{key}: is a kvgate, so this gate would gate a second time; give this kvgate role: "
            "front_door with gate.mode: off, or point it at the vLLM server"
        ], []
    if kv_status == 404:
        return [f"{key}: {missing_probe_api(name, url)}"], []
    if 401 in (kv_status, owner_status):
        return [
            f"{key}: its probe and owner routes answer 401: they need the replica key; set "
            "upstream.replica_api_key (or upstream.replica_api_key_file) to the key the server reads from "
            "KVGATE_REPLICA_API_KEY[_FILE] (docs/security.md)"
        ], []
    if owner_status != 200 or owner is None:
        return [], [
            f"{key}: no owner record (GET {OWNER_PATH} answered {owner_status}); start vLLM with "
            "the kvgate plugin, or a second gate enforcing on it cannot be detected"
        ]
    owned = owner.get("owned") is True
    if owned and settings.gate.mode == "enforce":
        return [
            f"{key}: a kvgate already enforces on it (lease {owner.get('expires_in_sec', 0)}s left); this one "
            "would only shadow it. One gate per replica: see docs/ARCHITECTURE.md"
        ], []
    return [], [f"{key}: owner record {'held' if owned else 'free'}"]
