"""One replica's usage readings, shared by the gate's concurrent admissions.

The replica answers a usage probe between two engine steps, so a probe lasts up to one
step. Readings are shared and reused (stale-while-revalidate) so that an admission under
steady load never waits on one:

- a reading younger than `max_age` is used as is;
- an older one is used at once while one shared refresh runs in the background, if that
  refresh started before the reading was `stale_limit` old (the probe's timeout past
  `max_age`: a refresh ends within its timeout, so no reading older than
  `max_age + 2 x timeout` is used);
- otherwise (no reading yet, or a gate idle for a while) the caller waits for the refresh;
- `usage(newer_than=T)` (a waiter woken by a release at T) insists on a probe started
  after T, so the reading sees the blocks that release freed;
- `revalidate()` (the gate, at each release) starts that refresh in the background
  when the reading is older than `max_age`, so the next turn decides at once: a
  replica whose turns arrive more than `stale_limit` apart would otherwise make each
  one wait a probe (up to an engine step) that sticky routing never waits.

Invariants: at most one refresh runs at a time per `newer_than` generation (concurrent
callers share it); a refresh that finishes after a younger one never replaces its reading.
The read itself (`read`) is the transport's: HTTP for `gate.probe.ReplicaProbe`, in-process
for the cluster simulation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvgate.gate.readings import UsageReading
from kvgate.gate.settings import ProbeSettings

_MUST_WAIT = object()  # `UsageCache._at_once`: no reading may be used without a probe


class UsageCache:
    """Usage readings of one replica from `read`, reused and refreshed by the module's rules."""

    def __init__(
        self,
        read: Callable[[], Awaitable[UsageReading | None]],
        max_age: float,
        stale_limit: float,
        clock: Callable[[], float],
    ) -> None:
        self._read = read
        self._max_age = max_age
        # A reading older than this is never used: the refresh that should have replaced
        # it started at least a probe timeout ago, so it failed or the gate was idle.
        self._stale_limit = stale_limit
        self._clock = clock
        self._cached: UsageReading | None = None
        self._cached_at = float("-inf")
        self._inflight: asyncio.Future[UsageReading | None] | None = None
        self._inflight_started = float("-inf")

    @classmethod
    def of(
        cls, read: Callable[[], Awaitable[UsageReading | None]], settings: ProbeSettings, clock: Callable[[], float]
    ) -> UsageCache:
        """The cache `gate.probe` settings ask for: readings reused for `usage_max_age_ms`, a
        stale one past that while its refresh runs, for at most one probe timeout more."""
        max_age = settings.usage_max_age_ms / 1000.0
        return cls(read, max_age, max_age + settings.timeout_sec, clock)

    @property
    def refreshing(self) -> bool:
        """A refresh is in flight."""
        return self._inflight is not None

    async def usage(self, newer_than: float | None = None) -> UsageReading | None:
        """The replica's usage by the module's rules; None when unknown (the read failed)."""
        now = self._clock()
        if newer_than is None or self._cached_at > newer_than:
            reading = self._at_once(now)
            if reading is not _MUST_WAIT:
                return reading  # type: ignore[return-value]
        inflight = self._inflight
        if inflight is None or self._inflight_started <= (now - self._max_age if newer_than is None else newer_than):
            inflight = self._start_refresh(now)
        # shield: a cancelled caller must not cancel the probe the others share.
        return await asyncio.shield(inflight)

    def ready(self) -> UsageReading | None:
        """The reading `usage()` would return without waiting (starting the background
        refresh it would start), or None when a caller must wait for a probe or the
        replica's usage is unknown: the gate's calm path, which never waits."""
        reading = self._at_once(self._clock())
        return None if reading is _MUST_WAIT else reading  # type: ignore[return-value]

    def revalidate(self) -> None:
        """Start a refresh in the background, unless the reading is younger than `max_age`
        or a refresh is already in flight (the replica's state changed: a turn ended)."""
        now = self._clock()
        if self._inflight is None and now - self._cached_at >= self._max_age:
            self._start_refresh(now)

    def close(self) -> None:
        """Cancel a refresh still in flight."""
        if self._inflight is not None:
            self._inflight.cancel()
            self._inflight = None

    def _at_once(self, now: float) -> UsageReading | None | object:
        """The cached reading if it may be used now (`usage()`'s rules), else _MUST_WAIT."""
        age = now - self._cached_at
        if age < self._max_age:
            return self._cached
        if self._inflight is not None:
            if self._inflight_started - self._cached_at < self._stale_limit:
                return self._cached  # its revalidation is under way
        elif age < self._stale_limit:
            self._start_refresh(now)
            return self._cached
        return _MUST_WAIT

    def _start_refresh(self, now: float) -> asyncio.Future[UsageReading | None]:
        task = asyncio.ensure_future(self._refresh(now))
        self._inflight, self._inflight_started = task, now
        return task

    async def _refresh(self, started: float) -> UsageReading | None:
        try:
            reading = await self._read()
        finally:
            if self._inflight_started == started:
                self._inflight = None
        if started >= self._cached_at:  # an older probe that finished late does not win
            self._cached, self._cached_at = reading, started
        return reading
