"""Tiers with the credentials of docs/security.md wired, as the compose and Kubernetes
examples run them: replicas answer their replica API only to the replica gates, replica
gates answer only the front doors, and a client's turn still goes through."""

from __future__ import annotations

from security_parts import CLEAN, chat, finish_every_session, until

from kvgate.bench.tiers import start_tiered

REPLICA_KEY = "tier-replica-key"
DOOR_KEY = "tier-door-key"


async def test_only_front_doors_reach_replica_gates_and_only_gates_the_replica_api(http):
    topology = await start_tiered(
        1,
        1,
        replica_gate={"upstream": {"replica_api_key": REPLICA_KEY}, "auth": {"api_keys": [DOOR_KEY]}},
        front_door={"upstream": {"api_key": DOOR_KEY}},
        replica_api_key=REPLICA_KEY,
        time_scale=0.0,
    )
    try:
        (door,), (gate,), (replica,) = topology.front_doors, topology.replica_gates, topology.replicas
        # the front door's health checks show its key: the replica gate is healthy to it
        await until(lambda: door.app.registry.any_healthy(), "the replica gate healthy to the front door")
        # the replica gate holds its replica's record (its claims carry the replica key)
        await until(lambda: gate.app.ownership.ownership().get(replica.name) is not None, "the gate's claim")
        assert gate.app.ownership.ownership()[replica.name].status == "owner"
        async with http.post(door.url + "/v1/chat/completions", json=chat(), headers={"x-session-id": "s"}) as resp:
            assert resp.status == 200 and resp.headers["x-kvgate-admission"] != "open", resp.headers
        # around the front door: refused at the replica gate, and at the replica's API
        async with http.post(gate.url + "/v1/chat/completions", json=chat(), headers={"x-session-id": "t"}) as resp:
            assert resp.status == 401
        async with http.get(gate.url + "/ready") as resp:
            assert resp.status == 401
        async with http.get(replica.url + "/v1/kvgate/kv") as resp:
            assert resp.status == 401
    finally:
        for kvgate in topology.replica_gates + topology.front_doors:
            finish_every_session(kvgate.app.admission)
        counts = topology.gate_counts()
        await topology.close()
    assert counts == CLEAN
