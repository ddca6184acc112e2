"""Tiered kvgate topologies in one process: replicas, a replica gate beside each, front doors.

Used by the scale-out tests and `python -m kvgate.bench.scale_out_load`. Every part is the real
thing (simulated replicas, `proxy.app.create_app` with the role's config) on loopback
ports; `Topology.close()` stops all of it, front doors first.

- `start_tiered(...)`: R simulated replicas, one `role: replica_gate` kvgate per replica
  (named like its replica), F `role: front_door` kvgates listing the replica gates.
- `start_single(...)`: R simulated replicas behind one standalone kvgate (the baseline).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvgate.bench.processes import Kvgate, start_in_process
from kvgate.simulator.replica_server import SimulatedReplica, start_simulated_replicas
from kvgate.simulator.reply_model import FIXED_LENGTHS


def _fixed_lengths(engine_options: dict) -> dict:
    """The replicas answer exactly max_tokens unless told otherwise (a benchmark sets every
    reply's length)."""
    return {"reply_model": FIXED_LENGTHS, **engine_options}


@dataclass
class Topology:
    replicas: list[SimulatedReplica]
    replica_gates: list[Kvgate] = field(default_factory=list)
    front_doors: list[Kvgate] = field(default_factory=list)

    async def close(self) -> None:
        for door in self.front_doors:
            await door.close()
        for gate in self.replica_gates:
            await gate.close()
        await asyncio.gather(*(r.stop() for r in self.replicas), return_exceptions=True)

    def gate_counts(self) -> dict[str, int]:
        """Live leases, windows, waiters, attempts and sessions over every kvgate's gates."""
        total: dict[str, int] = {}
        for kvgate in self.replica_gates + self.front_doors:
            for key, value in kvgate.app.admission.counts().items():
                total[key] = total.get(key, 0) + value
        return total


def _merge(base: dict, extra: dict | None) -> dict:
    out = dict(base)
    for key, value in (extra or {}).items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


async def start_tiered(
    num_replicas: int,
    num_front_doors: int,
    *,
    gate: dict | None = None,
    replica_gate: dict | None = None,
    front_door: dict | None = None,
    health_interval_sec: float = 0.2,
    **engine_options: Any,
) -> Topology:
    """The recommended topology; `replica_gate`/`front_door` are extra config merged into each tier's."""
    topology = Topology(await start_simulated_replicas(num_replicas, **_fixed_lengths(engine_options)))
    health = {"health": {"interval_sec": health_interval_sec, "timeout_sec": 1.0}}
    try:
        for replica in topology.replicas:
            config = _merge(
                {
                    "role": "replica_gate",
                    "replicas": [{"name": replica.name, "url": replica.url}],
                    "gate": {"mode": "enforce", **(gate or {})},
                    "balancer": health,
                },
                replica_gate,
            )
            topology.replica_gates.append(await start_in_process(replica.name, config))
        doors = [{"name": g.name, "url": g.url} for g in topology.replica_gates]
        for index in range(num_front_doors):
            config = _merge(
                {"role": "front_door", "replicas": doors, "gate": {"mode": "off"}, "balancer": health}, front_door
            )
            topology.front_doors.append(await start_in_process(f"door{index}", config))
    except BaseException:
        await topology.close()
        raise
    return topology


async def start_single(
    num_replicas: int,
    *,
    gate: dict | None = None,
    extra: dict | None = None,
    health_interval_sec: float = 0.2,
    **engine_options: Any,
) -> Topology:
    """One standalone kvgate in front of the replicas (the baseline); it is `front_doors[0]`."""
    topology = Topology(await start_simulated_replicas(num_replicas, **_fixed_lengths(engine_options)))
    try:
        config = _merge(
            {
                "replicas": [{"name": r.name, "url": r.url} for r in topology.replicas],
                "gate": {"mode": "enforce", **(gate or {})},
                "balancer": {"health": {"interval_sec": health_interval_sec}},
            },
            extra,
        )
        topology.front_doors.append(await start_in_process("single", config))
    except BaseException:
        await topology.close()
        raise
    return topology
