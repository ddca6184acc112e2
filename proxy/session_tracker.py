"""Per-session memory of the proxy: turn index and the replica the session ran on.

Bounded: at most `max_sessions` entries (least recently used dropped first), and an
entry idle longer than `idle_ttl_sec` is treated as gone. A session is forgotten when
it finishes. Forgetting only costs a restart of the turn count at 1 and a fresh
rendezvous choice, so the bound is safe. `responses` (proxy.response_chains) maps
Responses ids to their session and replica and is forgotten with the session.

The remembered replica makes stickiness stronger than the hash alone: a session
keeps its replica while that replica is healthy and registered, even when it drains
(drain stops *new* sessions) or when replicas are added, so its prefix cache stays
useful. Only when its replica leaves does the session move.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from kvgate.balancer import Replica
from kvgate.proxy.response_chains import ResponseChains


class SessionEntry:
    __slots__ = ("replica", "turns", "last_seen")

    def __init__(self, now: float) -> None:
        self.replica: Replica | None = None  # the replica the session last ran on
        self.turns = 0  # completed turns
        self.last_seen = now


class SessionTracker:
    def __init__(
        self, max_sessions: int = 100_000, idle_ttl_sec: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        self._max = max_sessions
        self._ttl = idle_ttl_sec
        self._clock = clock
        # Responses chains live and die with their sessions (same TTL; forgotten with them).
        self.responses = ResponseChains(max_sessions, idle_ttl_sec, clock)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> SessionEntry | None:
        """The live entry (touched as most recently used), or None if unknown or expired."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        now = self._clock()
        if now - entry.last_seen > self._ttl:
            del self._entries[session_id]
            return None
        entry.last_seen = now
        self._entries.move_to_end(session_id)
        return entry

    def touch(self, session_id: str) -> SessionEntry:
        """The entry, created if needed; evicts the least recently used over the bound."""
        entry = self.get(session_id)
        if entry is None:
            entry = SessionEntry(self._clock())
            self._entries[session_id] = entry
            if len(self._entries) > self._max:
                self._entries.popitem(last=False)
        return entry

    def forget(self, session_id: str) -> None:
        self._entries.pop(session_id, None)
        self.responses.forget_session(session_id)

    def forget_replica(self, replica) -> None:
        """Drop the pin of every session on a removed replica (they re-hash next turn)."""
        for entry in self._entries.values():
            if entry.replica is replica:
                entry.replica = None
        self.responses.forget_replica(replica)
