"""Replica health: the pure state machine, and the asyncio loop that feeds it.

A replica turns unhealthy after `unhealthy_after` consecutive failed checks and
healthy again after `healthy_after` consecutive successful ones; a check result that
agrees with the current state resets the opposite streak. Passive marking (a
connection error seen by the proxy) turns a replica unhealthy at once; the active
checks bring it back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from kvgate.balancer.settings import HealthSettings

log = logging.getLogger("kvgate.balancer")


@dataclass(frozen=True)
class HealthState:
    healthy: bool = True
    ok_streak: int = 0
    fail_streak: int = 0


def next_health(state: HealthState, ok: bool, unhealthy_after: int, healthy_after: int) -> HealthState:
    """The state after one check result."""
    if ok:
        streak = state.ok_streak + 1
        healthy = state.healthy or streak >= healthy_after
        return HealthState(healthy=healthy, ok_streak=streak, fail_streak=0)
    streak = state.fail_streak + 1
    healthy = state.healthy and streak < unhealthy_after
    return HealthState(healthy=healthy, ok_streak=0, fail_streak=streak)


class HealthChecker:
    """Polls GET {url}/health of every registered replica every `interval_sec`.

    All replicas are checked concurrently each round, each with `timeout_sec`; a
    replica answers healthy with any 2xx status. The loop survives every error.
    """

    def __init__(
        self,
        registry,
        settings: HealthSettings,
        path: str = "/health",
        busy_is_alive: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._registry = registry
        self._settings = settings
        self._path = path  # a front door asks replica gates for /ready (proxy/topology.py)
        # sent to replicas whose `credentials` is True only (a front door's key for its replica gates)
        self._headers = headers or {}
        # Tiers (proxy/topology.py): a check that times out while requests to the replica are in
        # flight is no evidence. A front door's replica gate answers /ready with a definitive 503
        # when its vLLM is down; a replica gate that drops its one replica refuses all its traffic.
        # Under load a timeout mostly measures event-loop lag (this process's or the replica's).
        self._busy_is_alive = busy_is_alive
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._rounds: list = []  # other per-round reads of the replicas, over the same session

    def add_round(self, read) -> None:
        """Also run `await read(session)` every round, beside the health checks (the replica
        metrics mirror). `read` must handle its own per-replica failures."""
        self._rounds.append(read)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._settings.timeout_sec),
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
        )
        self._task = asyncio.create_task(self._loop(), name="kvgate-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def check_all(self) -> None:
        """One round of checks over the replicas registered now."""
        replicas = self._registry.all()
        results = await asyncio.gather(*(self._check(r.url, r.credentials) for r in replicas))
        for replica, ok in zip(replicas, results):
            if ok is None:
                if self._busy_is_alive and replica.in_flight > 0:
                    continue
                ok = False
            self._registry.record_check(replica, ok)

    async def _check(self, url: str, credentials: bool = True) -> bool | None:
        """True on 2xx, False on another status or a failed connection, None on a timeout."""
        assert self._session is not None, "HealthChecker.start() must run first"
        try:
            async with self._session.get(url + self._path, headers=self._headers if credentials else None) as resp:
                await resp.read()
                return 200 <= resp.status < 300
        except TimeoutError:
            return None
        except (aiohttp.ClientError, OSError):
            return False

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.gather(self.check_all(), *(read(self._session) for read in self._rounds))
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one odd round stop health checking
                log.exception("health check round failed; retrying next interval")
            await asyncio.sleep(self._settings.interval_sec)
