"""The configuration schema of kvgate (SPEC.md section 3), as frozen dataclasses.

Every field has the default SPEC.md gives, so `Settings()` is the configuration of an
empty YAML file. Loading, environment overrides and validation live in
`proxy.config`; the parts here are plain data that the balancer, the gates and the
proxy receive.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ListenSettings:
    host: str = "127.0.0.1"
    port: int = 8000


@dataclass(frozen=True)
class ReplicaSettings:
    name: str
    url: str
    weight: float = 1.0


@dataclass(frozen=True)
class SessionSettings:
    header: str = "x-session-id"
    body_fields: tuple[str, ...] = ("session_id", "prompt_cache_key", "metadata.session_id", "metadata.user_id", "user")
    forward_session_id: bool = True
    finish_header: str = "x-session-finish"


@dataclass(frozen=True)
class HealthSettings:
    interval_sec: float = 2.0
    timeout_sec: float = 1.0
    unhealthy_after: int = 2
    healthy_after: int = 1


@dataclass(frozen=True)
class BalancerSettings:
    algorithm: str = "rendezvous"  # rendezvous | bounded_load
    load_factor: float = 1.25
    health: HealthSettings = field(default_factory=HealthSettings)


@dataclass(frozen=True)
class ProbeSettings:
    timeout_sec: float = 1.0
    usage_max_age_ms: float = 50.0


@dataclass(frozen=True)
class GateSettings:
    mode: str = "enforce"  # enforce | shadow | off
    policy: str = "contract"  # contract | seed; the agentic benchmark chose contract (docs/bench.md)
    high_watermark: float = 0.85
    hit_threshold: float = 0.80
    idle_grace_sec: float = 60.0
    wait_poll_sec: float = 1.0
    max_wait_sec: float = 0.0
    retain_session: bool = True
    headroom_blocks: int = 0
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    quiet_factor: float = 4.0  # a window ends once idle this many times its session's usual gap
    quiet_floor_sec: float = 0.5  # ... but never sooner than this (idle_grace_sec is the ceiling)
    work_conserving: bool = True  # contract: admit a held turn when holding costs more than the re-prefill


@dataclass(frozen=True)
class UpstreamSettings:
    connect_timeout_sec: float = 5.0
    read_timeout_sec: float = 600.0
    api_key: str | None = None


@dataclass(frozen=True)
class LimitsSettings:
    """The front door's limits and timeouts; defaults follow nginx's (docs/proxy.md)."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_head_bytes: int = 32 * 1024  # nginx: large_client_header_buffers 4 x 8k
    max_headers: int = 100  # Apache's LimitRequestFields; nginx bounds headers by size only
    header_timeout_sec: float = 60.0  # nginx client_header_timeout
    body_timeout_sec: float = 60.0  # nginx client_body_timeout (between two reads)
    keepalive_timeout_sec: float = 75.0  # nginx keepalive_timeout
    write_timeout_sec: float = 60.0  # nginx send_timeout (between two writes the client takes)
    max_connections: int = 4096  # client connections; nginx: worker_connections per worker
    max_buffered_response_bytes: int = 1024 * 1024  # larger non-streamed answers are relayed as they arrive


@dataclass(frozen=True)
class AdminSettings:
    token: str | None = None


@dataclass(frozen=True)
class OwnershipSettings:
    """Conflict detection (docs/ARCHITECTURE.md, Topologies): an enforcing gate claims each
    replica's owner record (`POST /v1/kvgate/owner`) and renews it every third of `ttl_sec`."""

    ttl_sec: float = 15.0  # 0: never claim (no conflict detection)
    gate_id: str | None = None  # None: <hostname>:<pid>:<random>, new at every start


@dataclass(frozen=True)
class Settings:
    listen: ListenSettings = field(default_factory=ListenSettings)
    replicas: tuple[ReplicaSettings, ...] = ()
    simulated_replicas: int = 2
    session: SessionSettings = field(default_factory=SessionSettings)
    balancer: BalancerSettings = field(default_factory=BalancerSettings)
    gate: GateSettings = field(default_factory=GateSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    role: str = "standalone"  # standalone | front_door | replica_gate (proxy/topology.py)
    ownership: OwnershipSettings = field(default_factory=OwnershipSettings)
