"""The balancer's configuration (`replicas` and `balancer` in docs/reference.md), as frozen dataclasses.

Plain data with the documented defaults. `kvgate.proxy.settings.Settings` composes
them into the whole configuration, and `kvgate.proxy.config` loads and validates them
(a replica's name and url with `balancer.replica_fields`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaSettings:
    name: str
    url: str
    weight: float = 1.0


@dataclass(frozen=True)
class HealthSettings:
    interval_sec: float = 2.0
    timeout_sec: float = 1.0
    unhealthy_after: int = 2
    healthy_after: int = 1


@dataclass(frozen=True)
class BalancerSettings:
    algorithm: str = "rendezvous"  # one of balancer.balancer.ALGORITHMS: rendezvous | bounded_load
    load_factor: float = 1.25
    health: HealthSettings = field(default_factory=HealthSettings)
