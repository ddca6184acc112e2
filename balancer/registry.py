"""The replica registry: which replicas exist, their health, drain flag and load.

`Replica` objects are long-lived and shared: the balancer ranks them, the proxy
counts its in-flight requests on them, the gates key on `.name`. A removed replica
keeps its object (in-flight requests still hold it) but is no longer returned by
the registry.
"""

from __future__ import annotations

import logging

from kvgate.balancer.health import HealthState, next_health
from kvgate.balancer.metrics import BalancerMetrics
from kvgate.balancer.replica_fields import replica_name_problem, replica_url_key, replica_url_problem
from kvgate.balancer.settings import HealthSettings

log = logging.getLogger("kvgate.balancer")


class Replica:
    """One upstream vLLM server. `in_flight` counts requests the proxy is relaying to it.
    `credentials`: whether kvgate sends it its upstream keys (False for a replica added at
    run time whose host the config does not trust)."""

    __slots__ = ("name", "url", "weight", "draining", "in_flight", "removed", "health", "credentials")

    def __init__(self, name: str, url: str, weight: float = 1.0, credentials: bool = True) -> None:
        self.name = name
        self.credentials = credentials
        self.url = url.rstrip("/")
        self.weight = float(weight)
        self.draining = False
        self.removed = False
        self.in_flight = 0
        self.health = HealthState()

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    def describe(self) -> dict:
        return {
            "name": self.name,
            "url": self.url,
            "weight": self.weight,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "credentials": self.credentials,
        }

    def __repr__(self) -> str:
        return f"Replica({self.name!r}, {self.url!r})"


class RegistryError(ValueError):
    """A registry change that cannot be made; the message says why."""


class ReplicaRegistry:
    def __init__(self, health: HealthSettings | None = None, metrics: BalancerMetrics | None = None) -> None:
        self._health = health or HealthSettings()
        self._metrics = metrics
        self._replicas: dict[str, Replica] = {}
        # The tuple of replicas that take new work, rebuilt on every change so the hot
        # path reads it without filtering.
        self._routable: tuple[Replica, ...] = ()

    def add(self, name: str, url: str, weight: float = 1.0, credentials: bool = True) -> Replica:
        problem = replica_name_problem(name)
        if problem:
            raise RegistryError(f"replica name {name!r} {problem}")
        if name in self._replicas:
            raise RegistryError(f"replica {name!r} already exists; remove it first or pick another name")
        problem = replica_url_problem(url)
        if problem:
            raise RegistryError(f"replica url {url!r} {problem}")
        same = next((r for r in self._replicas.values() if replica_url_key(r.url) == replica_url_key(url)), None)
        if same is not None:
            raise RegistryError(
                f"replica url {url!r} already exists as replica {same.name!r}; one server is listed once "
                "(its gate would otherwise count its cache twice)"
            )
        if not weight > 0:
            raise RegistryError(f"replica weight must be > 0, got {weight!r}")
        replica = Replica(name, url, weight, credentials)
        self._replicas[name] = replica
        self._changed(replica)
        return replica

    def remove(self, name: str) -> Replica:
        replica = self._replicas.pop(name, None)
        if replica is None:
            raise RegistryError(f"no replica named {name!r}")
        replica.removed = True
        self._rebuild()
        if self._metrics is not None:
            try:
                self._metrics.replica_healthy.remove(name)
            except KeyError:
                pass
        return replica

    def drain(self, name: str, draining: bool = True) -> Replica:
        replica = self.get(name)
        if replica is None:
            raise RegistryError(f"no replica named {name!r}")
        replica.draining = draining
        self._rebuild()
        return replica

    def get(self, name: str) -> Replica | None:
        return self._replicas.get(name)

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def routable(self) -> tuple[Replica, ...]:
        """Healthy, non-draining replicas: the ones that take new sessions."""
        return self._routable

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self._replicas.values())

    def record_check(self, replica: Replica, ok: bool) -> None:
        """Feed one active health-check result into the replica's state machine."""
        if replica.removed:
            return
        before = replica.healthy
        replica.health = next_health(replica.health, ok, self._health.unhealthy_after, self._health.healthy_after)
        if replica.healthy != before:
            log.warning("replica %s is now %s", replica.name, "healthy" if replica.healthy else "unhealthy")
            self._changed(replica)

    def record_answer(self, replica: Replica) -> None:
        """The replica answered a forwarded request: evidence of health as good as a check.

        It resets the failure streak of a healthy replica, so that health checks timing
        out on a replica that is busy but answering do not take it out of rotation.
        """
        if replica.health.fail_streak and replica.healthy:
            replica.health = HealthState(healthy=True, ok_streak=replica.health.ok_streak, fail_streak=0)

    def mark_failed(self, replica: Replica) -> None:
        """Passive marking: the proxy could not connect, so stop routing to it now."""
        if replica.removed or not replica.healthy:
            return
        replica.health = HealthState(healthy=False, ok_streak=0, fail_streak=self._health.unhealthy_after)
        log.warning("replica %s marked unhealthy: connection failed", replica.name)
        self._changed(replica)

    def _changed(self, replica: Replica) -> None:
        self._rebuild()
        if self._metrics is not None:
            self._metrics.replica_healthy.labels(replica.name).set(1 if replica.healthy else 0)

    def _rebuild(self) -> None:
        self._routable = tuple(r for r in self._replicas.values() if r.healthy and not r.draining)
