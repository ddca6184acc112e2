"""Conflict detection: an enforcing gate claims each replica's owner record, with a heartbeat.

Two gates enforcing on the same vLLM server each believe their books describe its
cache, and together admit twice the working set (docs/decisions/one-gate-per-replica.md). The server keeps a
small lease (the owner record, `kvgate.wire.owner_record`); every enforcing
gate claims it for each of its replicas and renews it every third of
`ownership.ttl_sec`. The gate that holds it enforces; a gate refused because another
holds it logs the conflict, sets `kvgate_gate_conflict{replica}` to 1, falls back to
shadow mode for that replica (it decides and records, never holds), and keeps
claiming: when the owner's lease lapses (the owner stopped or was reconfigured) it
takes the record and enforces again. The owner also sets the gauge while the record
counts contenders, so both sides of a conflict show it.

The record is the holder's (docs/security.md): the answer that grants it carries a nonce,
which this gate keeps per replica (never logged) and shows to renew and release it. Its
claims go under `instance_id(ownership.gate_id)`, unique per process, so two gates
configured with one id still see each other. Answers name no owner and count the
contenders, and so do the logs.

Pure: `next_ownership`, `gate_mode`, `conflict_flag`,
`transition_message`, `readiness`. The shell, `OwnershipClaims`, does the HTTP and
applies the verdicts through two callbacks. A replica without the owner route (404,
405, 501: no kvgate plugin, or an old one) is `unchecked`: the gate keeps enforcing,
says once that conflicts cannot be detected there, and the gauge stays 0. A failed
claim (timeout, connection refused) changes nothing, so a slow replica never flaps a
gate between enforce and shadow.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from kvgate.wire.owner_record import MAX_GATE_ID_CHARS, OWNER_PATH, OwnerAnswer, OwnerClaim
from kvgate.wire.replica_auth import replica_headers

log = logging.getLogger("kvgate.gate.ownership")

UNKNOWN = "unknown"  # no answer yet
OWNER = "owner"  # this gate holds the record: it enforces
CONFLICT = "conflict"  # another gate holds it: this gate shadows
UNCHECKED = "unchecked"  # the replica has no owner record: conflicts cannot be detected there

NO_API = "no_api"  # an outcome: the route does not exist on the replica
NO_API_STATUSES = frozenset({404, 405, 501})


# Characters of `ownership.gate_id` that fit beside the instance suffix in a claim's gate_id.
MAX_CONFIGURED_GATE_ID_CHARS = MAX_GATE_ID_CHARS - 9


def default_gate_id() -> str:
    """`<hostname>:<pid>:<random>`: unique per process start, readable in logs."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def instance_id(gate_id: str) -> str:
    """The id this process claims under: the configured one plus a random suffix, so two
    processes given one `ownership.gate_id` are two gates to the record."""
    return f"{gate_id[:MAX_CONFIGURED_GATE_ID_CHARS]}~{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Ownership:
    """This gate's standing on one replica's record; `contenders` counts the other gates
    claiming it (the record names none of them, nor its owner)."""

    status: str = UNKNOWN
    contenders: int = 0
    expires_in_sec: float = 0.0


def next_ownership(previous: Ownership, outcome: OwnerAnswer | str | None) -> Ownership:
    """The ownership after one claim: an answer, NO_API, or None (the claim failed: no change)."""
    if outcome is None:
        return previous
    if outcome == NO_API:
        return Ownership(UNCHECKED)
    assert isinstance(outcome, OwnerAnswer)
    status = OWNER if outcome.held else CONFLICT
    return Ownership(status, outcome.contenders, outcome.expires_in_sec)


def gate_mode(configured: str, ownership: Ownership) -> str:
    """The mode the replica's gate runs in: an enforcing gate that lost the record shadows."""
    if configured == "enforce" and ownership.status == CONFLICT:
        return "shadow"
    return configured


def conflict_flag(ownership: Ownership) -> int:
    """`kvgate_gate_conflict`: 1 while another gate holds the record, or contends for ours."""
    if ownership.status == CONFLICT or (ownership.status == OWNER and ownership.contenders > 0):
        return 1
    return 0


def transition_message(replica: str, gate_id: str, before: Ownership, after: Ownership) -> tuple[int, str] | None:
    """(log level, line) when the ownership changed in a way an operator must hear about."""
    if after.status == CONFLICT and before.status != CONFLICT:
        return logging.ERROR, (
            f"gate conflict on replica {replica}: another kvgate already enforces on it (lease "
            f"{after.expires_in_sec:.1f}s left); this kvgate ({gate_id}) falls back to shadow mode for it until "
            "that lease lapses. Two enforcing gates on one vLLM server over-admit: run one gate per replica "
            "(role: replica_gate) and route to it from front doors with gate.mode off (docs/ARCHITECTURE.md)"
        )
    if after.status == OWNER and after.contenders > 0 and (before.status != OWNER or before.contenders == 0):
        return logging.ERROR, (
            f"gate conflict on replica {replica}: {after.contenders} other kvgate(s) also try to enforce on "
            f"it; this kvgate ({gate_id}) holds it and keeps enforcing, they shadow"
        )
    if after.status == OWNER and before.status != OWNER:
        return logging.INFO, f"kvgate {gate_id} holds the owner record of replica {replica}: enforcing"
    if after.status == UNCHECKED and before.status != UNCHECKED:
        return logging.WARNING, (
            f"replica {replica} has no owner record ({OWNER_PATH}: start vLLM with the kvgate plugin): "
            "another gate enforcing on it could not be detected"
        )
    return None


def readiness(healthy: dict[str, bool], ownership: dict[str, Ownership]) -> tuple[bool, dict[str, str]]:
    """(ready, conflicts): ready while some replica is healthy and not gated by another kvgate;
    conflicts says, per replica this gate shadows because of a conflict, how long the other
    gate's lease has left (the record does not name that gate)."""
    conflicts = {
        name: f"another kvgate, lease {o.expires_in_sec:.0f}s left"
        for name, o in ownership.items()
        if o.status == CONFLICT
    }
    return any(ok and name not in conflicts for name, ok in healthy.items()), conflicts


class OwnershipClaims:
    """Claims the owner record of every replica `replicas()` lists, every ttl/3.

    `apply(replica, ownership)` is called after every claim whose outcome changed the
    ownership (the app sets the gate's mode and the gauge there). `start()` runs the
    first round before returning, so a late gate says so at start; `close()` releases
    the records it holds (ttl 0), so a restart does not wait a lease out.
    """

    def __init__(
        self,
        gate_id: str,
        ttl_sec: float,
        replicas: Callable[[], Iterable[tuple[str, str]]],
        apply: Callable[[str, Ownership], None],
        *,
        timeout_sec: float = 1.0,
        api_key: str | None = None,
        replica_api_key: str | None = None,
    ) -> None:
        self.gate_id = instance_id(gate_id)
        self.ttl_sec = ttl_sec
        self.interval_sec = ttl_sec / 3.0
        self._replicas = replicas
        self._apply = apply
        self._timeout = aiohttp.ClientTimeout(total=min(timeout_sec, self.interval_sec))
        self._headers = replica_headers(api_key, replica_api_key)
        self._state: dict[str, Ownership] = {}
        self._urls: dict[str, str] = {}
        self._nonces: dict[str, str] = {}  # replica URL -> the nonce of the record this gate holds there
        self._http: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._refused: set[str] = set()  # replica URLs that answered 401 (logged once)

    def ownership(self) -> dict[str, Ownership]:
        return dict(self._state)

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self.round()
        self._task = asyncio.create_task(self._loop(), name="kvgate-ownership")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_sec)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one odd round stop the heartbeat
                log.exception("ownership claim round failed; retrying next interval")

    async def round(self) -> None:
        """Claim (or renew) every replica's record once, concurrently."""
        replicas = dict(self._replicas())
        for name in [n for n in self._state if n not in replicas]:  # removed replicas: release, forget
            self._state.pop(name)
            await self._claim(self._urls.pop(name), 0)
            self._apply(name, Ownership())
        self._urls.update(replicas)
        names = list(replicas)
        outcomes = await asyncio.gather(*(self._claim(replicas[n], self.ttl_sec) for n in names))
        for name, outcome in zip(names, outcomes):
            before = self._state.get(name, Ownership())
            after = next_ownership(before, outcome)
            self._state[name] = after
            message = transition_message(name, self.gate_id, before, after)
            if message is not None:
                log.log(*message)
            if after != before:
                self._apply(name, after)

    async def _claim(self, url: str, ttl_sec: float) -> OwnerAnswer | str | None:
        assert self._http is not None, "start() first"
        try:
            async with self._http.post(
                url.rstrip("/") + OWNER_PATH,
                json=OwnerClaim(self.gate_id, ttl_sec, self._nonces.get(url)).to_json(),
                headers=self._headers,
                timeout=self._timeout,
            ) as resp:
                if resp.status in NO_API_STATUSES:
                    return NO_API
                if resp.status == 401 and url not in self._refused:
                    self._refused.add(url)  # said once per replica: every renewal would repeat it
                    log.error(
                        "replica %s refuses this gate's owner claims (401): it needs the replica key; set "
                        "upstream.replica_api_key to the key the server reads from KVGATE_REPLICA_API_KEY[_FILE] "
                        "(docs/security.md). Until then a second gate enforcing on it cannot be detected",
                        url,
                    )
                if resp.status != 200:
                    return None
                answer = OwnerAnswer.parse(await resp.json(content_type=None))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
        if answer.held and answer.nonce is not None and ttl_sec > 0:
            self._nonces[url] = answer.nonce
        else:  # released, lost or never held: a nonce shown again would only be refused
            self._nonces.pop(url, None)
        return answer

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._http is not None:
            held = [self._urls[n] for n, o in self._state.items() if o.status == OWNER and n in self._urls]
            await asyncio.gather(*(self._claim(url, 0) for url in held), return_exceptions=True)
            await self._http.close()
            self._http = None
