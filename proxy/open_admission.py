"""The admission controller used when no gate is configured: it admits everything.

Implements Seam 1 of docs/ARCHITECTURE.md (the interface of
`gate.admission.AdmissionController`): every acquire returns at once with reason
`open` and wait 0; releasing is idempotent; there is no per-gate state. Like the
gate, it counts its admissions in `kvgate_admissions_total` when given the metrics.
"""

from __future__ import annotations


class OpenLease:
    __slots__ = ("released",)

    reason = "open"
    wait_ms = 0.0

    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


class OpenAdmission:
    def __init__(self, metrics=None) -> None:
        self._metrics = metrics
        self._admitted: dict[str, object] = {}  # replica name -> counter child (hot path)

    async def acquire(self, replica, session_id: str | None, route_kind: str, body: dict) -> OpenLease:
        if self._metrics is not None:
            child = self._admitted.get(replica.name)
            if child is None:
                child = self._admitted[replica.name] = self._metrics.admissions.labels(replica.name, "open")
            child.inc()
        return OpenLease()

    def finish_session(self, session_id: str) -> None:
        return None

    def remove_replica(self, name: str) -> None:
        self._admitted.pop(name, None)

    def state(self) -> dict:
        return {}
