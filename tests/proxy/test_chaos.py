"""Agents that misbehave, through the whole path under pressure: nothing is lost, hung or leaked.

The real proxy and gate (`working_set`, pins) before two simulated replicas whose caches
hold a few of the sessions' contexts at a time, so turns are held, windows lost and pins
yielded. Seeded agents run growing sessions on the chat, Anthropic messages and Responses
APIs (a Responses session chained by `previous_response_id`) and, now and then:
- give up on a turn at a random moment (at the gate, before the answer's head, or
  mid-stream), or read a stream only to its first chunk and hang up;
- send a turn again while the first is still out (a retry);
- end the session with `x-session-finish`, or silently.
The cases: both replicas stay, and two tenants' agents send the same session ids (neither
touches the other's turns); a replica stops mid-run; replicas in processes of their own,
one killed mid-run (a stream it was answering ends with kvgate's error event in the API's
shape, `upstream_stream_broken`, never with a connection cut short); and the agents go
through two front doors over a replica gate per replica (no tier keeps anything).

Every answer a client reads to its end is a whole reply or an error in the API's shape.
Afterwards no lease, waiter, attempt, request in flight or engine request is left; the
windows end as their sessions go quiet, each releasing its KV pin at once (not at the pin's
ttl); and once the grace has passed, no session is left either.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import aiohttp

from kvgate.bench.processes import ReplicaShape, ServerGroup
from kvgate.bench.tiers import start_tiered
from kvgate.proxy.tenancy import tenant_tag
from kvgate.simulator.replica_server import start_simulated_replicas
from kvgate.simulator.reply_model import FIXED_LENGTHS
from tests.chaos_agents import (
    CHAOS_GATE,
    EXPECTED_ERRORS,
    STOPPED_ERRORS,
    Sessions,
    Tally,
    agent,
    assert_nothing_left,
    kvgate_before,
)

KEY = "the-replica-key"
SESSIONS = 24
SESSION_SHAPE = Sessions()  # 4-7 turns of 50-100 words each: several times the caches
# Replicas whose caches hold a few sessions' contexts at a time, steps a few milliseconds long.
SHAPE = {
    "num_blocks": 48,
    "block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "max_model_len": 768,
    "time_scale": 0.3,
}


@contextlib.asynccontextmanager
async def pressured_stack(client_keys: tuple[str, ...] = ()):
    """Two simulated replicas of SHAPE in this process, kvgate before them (taking
    `client_keys`, when given)."""
    replicas = await start_simulated_replicas(2, **SHAPE, replica_api_key=KEY, reply_model=FIXED_LENGTHS)
    try:
        async with kvgate_before([(r.name, r.url) for r in replicas], KEY, client_keys=client_keys) as (app, http):
            yield app, http, replicas
    finally:
        for replica in replicas:
            await replica.stop()


async def stop_replica(replica, after_sec: float) -> None:
    """Stop `replica` (its server closes, its turns in flight end first) after `after_sec`."""
    await asyncio.sleep(after_sec)
    await replica.stop()


async def test_a_replica_that_stops_mid_run_leaves_nothing_behind():
    tally = Tally(STOPPED_ERRORS)
    async with pressured_stack() as (app, http, replicas):
        agents = (agent(http, index, 2, tally, SESSION_SHAPE) for index in range(SESSIONS))
        await asyncio.gather(stop_replica(replicas[1], 0.5), *agents)
        await assert_nothing_left([app], [replicas[0].url], KEY)
    assert tally.statuses.get(200, 0) > SESSIONS * 3, tally
    assert tally.gave_up and tally.hung_up and tally.held, tally  # the chaos and the pressure happened


async def test_a_replica_that_crashes_mid_run_leaves_nothing_behind(tmp_path):
    """Replicas in processes of their own, one SIGKILLed mid-run: its answers in flight are cut
    short or answered 502, its sessions move, and nothing is left behind on either side."""
    tally = Tally(STOPPED_ERRORS, crash=True)
    async with ServerGroup(tmp_path) as group:
        shape = ReplicaShape(**SHAPE)
        replicas = [(name, await group.start_replica(name, shape)) for name in ("r0", "r1")]
        async with kvgate_before(replicas) as (app, http):

            async def crash() -> None:
                await asyncio.sleep(0.5)
                group.kill("r1")

            await asyncio.gather(crash(), *(agent(http, index, 3, tally, SESSION_SHAPE) for index in range(SESSIONS)))
            await assert_nothing_left([app], [replicas[0][1]])
    assert tally.statuses.get(200, 0) > SESSIONS * 3, tally


async def test_misbehaving_agents_through_front_doors_leave_nothing_behind_in_any_tier():
    """The recommended topology (docs/proxy.md): two front doors over a replica gate per
    replica. Agents spread over both doors; afterwards no tier keeps anything."""
    tally = Tally(EXPECTED_ERRORS)
    topology = await start_tiered(2, 2, gate=CHAOS_GATE, **SHAPE)
    try:
        doors = [aiohttp.ClientSession(base_url=door.url) for door in topology.front_doors]
        try:
            agents = (agent(doors[index % 2], index, 4, tally, SESSION_SHAPE) for index in range(SESSIONS))
            await asyncio.gather(*agents)
        finally:
            for door in doors:
                await door.close()
        kvgates = [k.app for k in topology.replica_gates + topology.front_doors]
        await assert_nothing_left(kvgates, [r.url for r in topology.replicas])
    finally:
        await topology.close()
    assert tally.statuses.get(200, 0) > SESSIONS * 3, tally
    assert tally.gave_up and tally.hung_up and tally.held, tally


async def test_two_tenants_with_the_same_session_ids_under_pressure_leave_nothing_behind_and_keep_apart():
    """Both replicas stay. Two client keys, so two tenants (docs/security.md), whose agents
    send the same session ids and, until one of them retries, the same turns at once. Only
    the first tenant's agents retry: a 409 admission_superseded may answer them, never the
    second tenant's; every session the gates book carries its tenant's tag."""
    keys = ("tenant-one-key", "tenant-two-key")
    retrying, steady = Tally(EXPECTED_ERRORS), Tally({503: "admission_timeout"})
    booked: set[str] = set()
    async with pressured_stack(client_keys=keys) as (app, http, replicas):

        async def watch_the_books() -> None:
            while True:
                for gate in app.admission.gates().values():
                    booked.update(gate.session_keys())
                await asyncio.sleep(0.02)

        watcher = asyncio.ensure_future(watch_the_books())
        try:
            first = replace(SESSION_SHAPE, client_key=keys[0])
            second = replace(SESSION_SHAPE, client_key=keys[1], retries=False)
            await asyncio.gather(
                *(agent(http, index, 5, retrying, first) for index in range(SESSIONS // 2)),
                *(agent(http, index, 5, steady, second) for index in range(SESSIONS // 2)),
            )
        finally:
            watcher.cancel()
        await assert_nothing_left([app], [r.url for r in replicas], KEY)
    assert {key.split(":", 1)[0] for key in booked} == {tenant_tag(key) for key in keys}, sorted(booked)[:4]
    assert retrying.statuses.get(200, 0) + steady.statuses.get(200, 0) > SESSIONS * 3, (retrying, steady)
    assert steady.statuses.get(200, 0) > SESSIONS, steady
    chaos = (retrying.gave_up + steady.gave_up, retrying.hung_up + steady.hung_up, retrying.held + steady.held)
    assert all(chaos), (retrying, steady)  # the chaos and the pressure happened
