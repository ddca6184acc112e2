"""Where a new session goes through the real proxy (`gate.place_sessions`): to the replica
whose gate books the fewest sessions, pinned at once; rendezvous where placement is off."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import aiohttp
import pytest

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import ProxyApp, create_app
from kvgate.proxy.settings import Settings
from kvgate.simulator.replica_server import start_simulated_replicas

CLEAN = {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}


@contextlib.asynccontextmanager
async def running(gate: GateSettings):
    """kvgate before two simulated replicas, and a client; everything stopped on exit."""
    replicas = await start_simulated_replicas(2, time_scale=0, num_blocks=256, block_size=16)
    app = create_app(
        Settings(replicas=tuple(ReplicaSettings(r.name, r.url) for r in replicas), gate=gate), health_checks=False
    )
    try:
        host, port = await app.start("127.0.0.1", 0)
        async with aiohttp.ClientSession(f"http://{host}:{port}") as http:
            yield app, http
    finally:
        await app.close()
        for replica in replicas:
            await replica.stop()


async def turn(http: aiohttp.ClientSession, session: str, text: str, finish: bool = False) -> str:
    """One chat turn of `session`; the replica that served it."""
    headers = {"x-session-id": session, **({"x-session-finish": "true"} if finish else {})}
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    async with http.post("/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvgate-replica"]


def same_rendezvous_ids(app: ProxyApp, n: int) -> list[str]:
    """`n` session ids that rendezvous hashing sends to one replica."""
    ids = [f"agent-{i}" for i in range(200)]
    first = app.balancer.choose(ids[0])
    return [i for i in ids if app.balancer.choose(i) is first][:n]


@pytest.mark.parametrize("place", [True, False])
async def test_new_sessions_go_to_the_replica_whose_gate_books_fewest(place):
    async with running(GateSettings(place_sessions=place)) as (app, http):
        ids = same_rendezvous_ids(app, 4)
        first = {s: await turn(http, s, f"task of {s}") for s in ids}
        if place:
            assert sorted(Counter(first.values()).values()) == [2, 2], first
        else:
            assert len(set(first.values())) == 1, first  # all on their rendezvous replica
        again = {s: await turn(http, s, f"task of {s}, then more", finish=True) for s in ids}
        assert again == first  # every session stays where it was placed
        assert app.admission.counts() == CLEAN


async def test_a_new_sessions_concurrent_first_turns_go_together():
    """Placed by the books, a session's first turn is pinned before it is admitted: its
    concurrent turns (subagents, a side request) all go where it went."""
    async with running(GateSettings()) as (app, http):
        served = await asyncio.gather(*(turn(http, "fan-out", f"subtask {k}") for k in range(6)))
        assert len(set(served)) == 1, served
        assert await turn(http, "next", "task", finish=True) != served[0]  # the emptier replica
        app.admission.finish_session("fan-out")
        assert app.admission.counts() == CLEAN
