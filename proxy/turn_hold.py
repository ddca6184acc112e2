"""What one admitted request holds while it runs: a place in its replica's in-flight
count and the gate's lease, taken together and given back together.

Invariant: `with Hold(replica, lease)` adds one to `replica.in_flight` on entry; the
place and the lease are given back exactly once, by the first `release()` or else on
leaving the block, whichever way it is left (answer relayed, upstream failed, client
gone, task cancelled). `served` says whether a prompt was served: a lease given back
unserved ends the window its admission opened (gate.gate.Lease.release).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Protocol

from kvgate.balancer import Replica
from kvgate.wire.kv_pins import Pin


class TurnLease(Protocol):
    """The gate's lease as the proxy uses it (gate.gate.Lease)."""

    @property
    def reason(self) -> str: ...

    @property
    def wait_ms(self) -> float: ...

    @property
    def priority(self) -> int | None: ...  # the vLLM priority to forward the request with (None: as sent)

    @property
    def pin(self) -> Pin | None: ...  # the KV pin to forward the request with (None: unpinned)

    def release(self, served: bool = True) -> None: ...

    def learn(self, prompt_tokens: int, cached_tokens: int | None, output_tokens: int | None = None) -> None: ...

    def end_run(self) -> None: ...  # the reply ended the agent's run: the session's window ends


class TurnAdmission(Protocol):
    """The gate as the proxy's turns use it (gate.admission.AdmissionController)."""

    async def acquire(
        self,
        replica: Replica,
        session_id: str | None,
        route_kind: str,
        body: Mapping[str, object],
        elsewhere: Callable[[], Iterable[Replica]] | None = None,
        body_size: int | None = None,  # the bytes of the JSON `body` goes upstream as
    ) -> TurnLease: ...

    def finish_session(self, session_id: str) -> None: ...

    def placement(self) -> Callable[[Replica], int] | None: ...


class Hold:
    """A request's place on its replica and its lease, until `release()` or the end of
    the `with` block (a class, not a generator: it is on every request's path)."""

    __slots__ = ("replica", "lease", "served", "_released")

    def __init__(self, replica: Replica, lease: TurnLease) -> None:
        self.replica = replica
        self.lease = lease
        self.served = False  # set once the replica answered with a status under 400
        self._released = False
        replica.in_flight += 1

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()

    def release(self) -> None:
        """Give back the place and the lease; only the first call does anything."""
        if self._released:
            return
        self._released = True
        self.replica.in_flight -= 1
        self.lease.release(served=self.served)


class _Ungated:
    """The lease of a request the gate never sees (kvgate.wire.routes.PASSTHROUGH): nothing to
    give back; its answer carries no admission headers (reason "")."""

    reason = ""
    wait_ms = 0.0
    priority = None
    pin = None

    def release(self, served: bool = True) -> None:
        return None

    def learn(self, prompt_tokens: int, cached_tokens: int | None, output_tokens: int | None = None) -> None:
        return None

    def end_run(self) -> None:
        return None


UNGATED: TurnLease = _Ungated()
