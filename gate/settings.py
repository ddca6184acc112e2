"""The gate's configuration (`gate` and `ownership` in docs/reference.md), as frozen dataclasses.

Plain data with the documented defaults. `kvgate.proxy.settings.Settings` composes
them into the whole configuration, and `kvgate.proxy.config` loads and validates them;
the gate itself never reads a file or the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ProbeSettings:
    timeout_sec: float = 1.0
    usage_max_age_ms: float = 50.0


@dataclass(frozen=True)
class GateSettings:
    mode: str = "enforce"  # one of gate.gate.MODES: enforce | shadow | off
    # a name in gate.policies.registry.POLICIES; the agentic benchmark chose working_set (docs/bench.md)
    policy: str = "working_set"
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
    # a session is late (its pin's ttl, the late windows a capped wait reclaims) once idle its
    # usual gap, but never sooner than this (docs/decisions/quiet-and-late-floors.md)
    late_floor_sec: float = 0.5
    work_conserving: bool = True  # working_set: admit a held turn when holding costs more than the re-prefill
    # working_set: a held turn goes in once it waited this x its session's turn time, into a
    # window made of late idle windows (0: no cap; docs/decisions/wait-cap.md)
    wait_cap_factor: float = 0.5
    # working_set: a turn it would hold is forwarded at this vLLM priority instead, on a replica
    # that schedules by priority (`--scheduling-policy priority`); 0: held at the proxy
    held_priority: int = 0
    # KV pins (gate/pins.py): "auto" forwards a turn that gets a window with a pin on a replica
    # that keeps pins (its kv answer reports them); "off" never pins
    pins: str = "auto"
    # enforce mode: a session the proxy has not pinned yet goes to the replica whose gate books
    # the fewest live sessions (per unit of weight), not to its rendezvous replica (docs/gate.md)
    place_sessions: bool = True
    # enforce mode: a held turn moves to a replica with nothing in flight or waiting once it has
    # waited as long as re-prefilling its prompt takes, and its session with it (gate/relocation.py)
    relocate_held: bool = True


@dataclass(frozen=True)
class OwnershipSettings:
    """Conflict detection (docs/ARCHITECTURE.md, Topologies; `gate/ownership.py`): an enforcing
    gate claims each replica's owner record (`POST /v1/kvgate/owner`) and renews it every third
    of `ttl_sec`."""

    ttl_sec: float = 15.0  # 0: never claim (no conflict detection)
    gate_id: str | None = None  # None: <hostname>:<pid>:<random>, new at every start
