"""The configuration schema of kvgate (docs/reference.md, Configuration), as frozen dataclasses.

Every field has its documented default, so `Settings()` is the configuration of an
empty YAML file. Loading, environment overrides and validation live in
`proxy.config`. Each part owns its own sections: `Settings` composes the gate's
(`gate.settings`: `gate`, `ownership`) and the balancer's (`balancer.settings`:
`replicas`, `balancer`) with the front door's own, defined here. Import a part's
dataclasses from the part, not from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.balancer.settings import BalancerSettings, ReplicaSettings
from kvgate.gate.settings import GateSettings, OwnershipSettings


@dataclass(frozen=True)
class ListenSettings:
    host: str = "127.0.0.1"
    port: int = 8000


# The headers agent clients put their session in by themselves (read after kvgate's own
# `header`, in this order): Claude Code, Codex CLI, OpenCode.
CLIENT_SESSION_HEADERS = ("x-claude-code-session-id", "session_id", "x-session-affinity")


@dataclass(frozen=True)
class SessionSettings:
    header: str = "x-session-id"
    client_headers: tuple[str, ...] = CLIENT_SESSION_HEADERS
    body_fields: tuple[str, ...] = ("session_id", "prompt_cache_key", "metadata.session_id", "metadata.user_id", "user")
    forward_session_id: bool = True
    finish_header: str = "x-session-finish"
    # a turn whose reply calls no tool where the model could have (the agent's run is over:
    # proxy/reply_end.py) ends the session's window after it, as finish_header does
    finish_on_final_reply: bool = True


@dataclass(frozen=True)
class UpstreamSettings:
    """How kvgate reaches its replicas, and the credentials it presents (docs/security.md).

    `api_key` (or the first line of `api_key_file`) is the replicas' client key: vLLM's
    `--api-key`, or the `auth.api_keys` of a replica gate behind a front door.
    `replica_api_key` (or `replica_api_key_file`) is the gates' own credential for the
    replicas' owner and probe routes, which only gates may use; the vLLM servers read the
    same secret from `KVGATE_REPLICA_API_KEY` or `KVGATE_REPLICA_API_KEY_FILE`.
    `credential_hosts`: replicas added at run time (`POST /admin/replicas`) get neither
    key unless their URL's host is listed here; configured replicas always get them.
    """

    connect_timeout_sec: float = 5.0
    read_timeout_sec: float = 600.0
    api_key: str | None = None
    api_key_file: str | None = None
    replica_api_key: str | None = None
    replica_api_key_file: str | None = None
    credential_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class LimitsSettings:
    """The front door's limits and timeouts; defaults follow nginx's (docs/proxy.md)."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_head_bytes: int = 32 * 1024  # nginx: large_client_header_buffers 4 x 8k
    max_headers: int = 100  # Apache's LimitRequestFields; nginx bounds headers by size only
    header_timeout_sec: float = 60.0  # nginx client_header_timeout
    body_timeout_sec: float = 60.0  # nginx client_body_timeout (between two reads)
    body_deadline_sec: float = 300.0  # the whole body, however steadily it trickles in
    keepalive_timeout_sec: float = 75.0  # nginx keepalive_timeout
    write_timeout_sec: float = 60.0  # nginx send_timeout (between two writes the client takes)
    max_connections: int = 4096  # client connections; nginx: worker_connections per worker
    max_buffered_response_bytes: int = 1024 * 1024  # larger non-streamed answers are relayed as they arrive


@dataclass(frozen=True)
class AdminSettings:
    token: str | None = None


@dataclass(frozen=True)
class AuthSettings:
    """Client authentication, as vLLM's `--api-key` has it (docs/security.md): with any key
    set, every route but `/health` needs `Authorization: Bearer <key>` (compared in constant
    time); `/admin/*` takes `admin.token` instead. `api_keys_file`: one key per line (blank
    lines and lines starting with # skipped), added to `api_keys`."""

    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None


@dataclass(frozen=True)
class LogSettings:
    access: bool = False  # one logfmt line per forwarded request (proxy/access_log.py)


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
    auth: AuthSettings = field(default_factory=AuthSettings)
    role: str = "standalone"  # standalone | front_door | replica_gate (proxy/topology.py)
    ownership: OwnershipSettings = field(default_factory=OwnershipSettings)
    log: LogSettings = field(default_factory=LogSettings)
