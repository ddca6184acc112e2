"""The proxy's entry point to admission (docs/ARCHITECTURE.md, Seam 1).

`AdmissionController` keeps one `Gate` per replica, created lazily on the replica's
first request and keyed by its name. It books sessions under `session_key(id)` (ids
over 512 bytes are replaced by their SHA-256 hex digest, `gate.session_key`: the one
bound, the proxy's too, so a 10 KB id costs 64 bytes per record), and it builds
each gate's `ReplicaProbe` over one aiohttp ClientSession of its own, opened on the
first probe and closed by `aclose()`.

No metric carries a session id: the gates label metrics by replica and reason only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import aiohttp

from kvgate.gate.errors import (
    AdmissionError,
    AdmissionSuperseded,
    AdmissionTimeout,
    PromptTooLong,
    ReplicaUnavailable,
    SessionRelocated,
)
from kvgate.gate.gate import Gate, Lease
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.policies.registry import get_policy
from kvgate.gate.probe import Probe, ReplicaProbe
from kvgate.gate.session_key import session_key
from kvgate.gate.settings import GateSettings

__all__ = [
    "AdmissionController",
    "AdmissionError",
    "AdmissionSuperseded",
    "AdmissionTimeout",
    "Lease",
    "PromptTooLong",
    "ReplicaUnavailable",
    "SessionRelocated",
    "session_key",
]

ProbeFactory = Callable[[str, str], Probe]  # (replica name, replica url) -> probe


class ReplicaAddress(Protocol):
    """What admission needs of a replica (`balancer.Replica` has both): its name, which keys
    its gate, and its base URL, which its probe reads."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...


class AdmissionController:
    """One admission gate per replica, behind the interface the proxy uses.

    The probes share one ClientSession the controller opens on first use (so it can
    be built before an event loop runs) and `aclose()` closes. api_key: sent as a
    Bearer token to replicas' probe endpoints (vLLM's --api-key guards every path
    under /v1); replica_api_key: the gates' credential for the probe API
    (`kvgate.wire.replica_auth`). A replica whose `credentials` attribute is False gets
    neither. clock and probe_factory exist for tests and the simulator.
    """

    def __init__(
        self,
        settings: GateSettings,
        metrics: GateMetrics,
        *,
        api_key: str | None = None,
        replica_api_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        probe_factory: ProbeFactory | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.policy = get_policy(settings.policy)  # fail at start on an unknown name
        self._api_key = api_key
        self._replica_api_key = replica_api_key
        self._untrusted: set[str] = set()  # replicas that get no credentials (proxy/client_auth.py)
        self._clock = clock
        self._probe_factory = probe_factory or self._replica_probe
        self._gates: dict[str, Gate] = {}
        self._urls: dict[str, str] = {}
        self._modes: dict[str, str] = {}  # per-replica mode overrides (gate/ownership.py: conflict -> shadow)
        self._own_http: aiohttp.ClientSession | None = None

    # ---------------------------------------------------------------- wiring

    def _http(self) -> aiohttp.ClientSession:
        if self._own_http is None or self._own_http.closed:
            self._own_http = aiohttp.ClientSession()
        return self._own_http

    def _replica_probe(self, name: str, url: str) -> Probe:
        if name in self._untrusted:  # probed without credentials: it shows none of kvgate's keys
            return ReplicaProbe(name, url, self._http, self.settings.probe, self.metrics, None, self._clock)
        return ReplicaProbe(
            name, url, self._http, self.settings.probe, self.metrics, self._api_key, self._clock, self._replica_api_key
        )

    async def aclose(self) -> None:
        """Fail every waiter (the proxy is stopping) and close the controller's own ClientSession."""
        for name in list(self._gates):
            self.remove_replica(name)
        if self._own_http is not None:
            await self._own_http.close()
            self._own_http = None

    def gate_for(self, name: str, url: str) -> Gate:
        """The replica's gate, created on first use; a changed url gets a fresh probe."""
        gate = self._gates.get(name)
        if gate is None:
            gate = Gate(
                name,
                self._probe_factory(name, url),
                self._settings_for(name),
                self.metrics,
                self._clock,
                self.policy,
                self._replica_idle,
            )
            self._gates[name] = gate
            self._urls[name] = url
        elif self._urls[name] != url:
            gate.probe = self._probe_factory(name, url)
            self._urls[name] = url
        return gate

    def _gate_of(self, replica: ReplicaAddress) -> Gate:
        """`gate_for` the replica, whose probe shows kvgate's credentials only when the replica
        gets them (its `credentials` attribute; True when it has none)."""
        gate = self._gates.get(replica.name)
        if gate is None or self._urls[replica.name] != replica.url:
            if getattr(replica, "credentials", True):
                self._untrusted.discard(replica.name)
            else:
                self._untrusted.add(replica.name)
            gate = self.gate_for(replica.name, replica.url)
        return gate

    def _settings_for(self, name: str) -> GateSettings:
        mode = self._modes.get(name)
        return self.settings if mode is None else dataclasses.replace(self.settings, mode=mode)

    def set_replica_mode(self, name: str, mode: str) -> None:
        """Run the replica's gate in `mode` from now on (`gate.ownership`: a gate that does not hold
        the replica's owner record shadows it). Waiters re-decide at their next wake-up or poll."""
        if mode == self.settings.mode:
            self._modes.pop(name, None)
        else:
            self._modes[name] = mode
        gate = self._gates.get(name)
        if gate is not None:
            gate.settings = self._settings_for(name)

    # -------------------------------------------------------------- Seam 1

    async def acquire(
        self,
        replica: ReplicaAddress,
        session_id: str | None,
        route_kind: str,
        body: Mapping[str, object],
        elsewhere: Callable[[], Iterable[ReplicaAddress]] | None = None,
        body_size: int | None = None,
    ) -> Lease:
        """Admit one request to `replica` (has .name and .url), or raise an AdmissionError.

        session_id None is anonymous. `body` is read, never modified. Cancelling the
        call (client gone) leaves nothing behind. `elsewhere`: the other replicas the turn
        may move to while it is held (routable, in the caller's order of preference); a
        move raises `SessionRelocated` naming the replica to acquire it on instead
        (`gate/relocation.py`). `body_size`: the bytes of the JSON `body` goes upstream as,
        when the caller has them (`Gate.acquire`).
        """
        gate = self._gate_of(replica)
        key = None if session_id is None else session_key(session_id)
        peers = None if elsewhere is None or key is None else _IdlePeers(self, elsewhere)
        return await gate.acquire(key, route_kind, body, peers, body_size)

    def _replica_idle(self, name: str) -> None:
        """Replica `name` has nothing in flight or waiting: the other replicas' held turns decide
        again, and may move there."""
        if not self.settings.relocate_held:
            return
        for other, gate in self._gates.items():
            if other != name:
                gate.wake_waiters()

    def probe_api(self, name: str) -> bool | None:
        """Whether replica `name` serves the probe API, as its gate last learned: None
        while unknown (no gate yet, or it has not answered either way)."""
        gate = self._gates.get(name)
        return None if gate is None else getattr(gate.probe, "probe_api", None)

    async def learn_probe_api(self, replica: ReplicaAddress) -> bool | None:
        """Ask `replica` for its usage once if its probe API is still unknown (at start,
        before any turn); the probe logs a missing API with the fix and sets
        `kvgate_replica_probe_api`. Returns what is known after."""
        known = self.probe_api(replica.name)
        if known is None:
            gate = self._gate_of(replica)
            await gate.probe.usage()
            known = self.probe_api(replica.name)
        return known

    def placement(self) -> Callable[[ReplicaAddress], int] | None:
        """What places a new session (`gate.place_sessions`, enforce mode): the live sessions
        each replica's gate books (`live_sessions`); None: the balancer's algorithm places it."""
        if self.settings.mode != "enforce" or not self.settings.place_sessions:
            return None
        return self.live_sessions

    def live_sessions(self, replica: ReplicaAddress) -> int:
        """The named sessions the replica's gate books (0 before its first turn)."""
        gate = self._gates.get(replica.name)
        return 0 if gate is None else gate.live_sessions()

    def finish_session(self, session_id: str) -> None:
        """End the session's ownership window on every replica; unknown ids are a no-op."""
        key = session_key(session_id)
        for gate in self._gates.values():
            gate.finish_session(key)

    def remove_replica(self, name: str) -> None:
        """The replica left: its waiters raise ReplicaUnavailable; its gate is forgotten."""
        gate = self._gates.pop(name, None)
        self._urls.pop(name, None)
        self._untrusted.discard(name)
        if gate is not None:
            gate.close(f"replica {name} was removed while this request waited for admission")

    def state(self) -> dict[str, Any]:
        """Per gate (by replica name): windows in flight and idle, waiters, and per
        session its reason counts and num_superseded."""
        return {name: gate.state() for name, gate in self._gates.items()}

    def gates(self) -> Mapping[str, Gate]:
        """The gates by replica name, to read (the status page: proxy/status_page.py); never to change."""
        return self._gates

    def counts(self) -> dict[str, int]:
        """Live leases, windows, waiters, attempts and sessions over all gates."""
        total = {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}
        for gate in self._gates.values():
            for key, value in gate.counts().items():
                total[key] += value
        return total


class _IdlePeers:
    """`gate.relocation.Elsewhere` over the replicas a caller offers: the first whose gate is idle
    (a replica without a gate yet has had no turn of this kvgate: idle where it would enforce)."""

    def __init__(self, controller: AdmissionController, offered: Callable[[], Iterable[ReplicaAddress]]) -> None:
        self._controller = controller
        self._offered = offered
        self._seen: dict[str, ReplicaAddress] = {}

    def idle_replica(self) -> str | None:
        controller = self._controller
        for replica in self._offered():
            gate = controller._gates.get(replica.name)
            idle = gate.idle if gate is not None else controller._settings_for(replica.name).mode == "enforce"
            if idle:
                self._seen[replica.name] = replica
                return replica.name
        return None

    def claim(self, name: str) -> None:
        self._controller._gate_of(self._seen[name]).claim()
