"""Fixtures of the security tests: real replicas and kvgates on loopback, stopped after each
test, every kvgate checked for leftover leases, windows, waiters and attempts."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from security_parts import CLEAN, finish_every_session

from kvgate.bench.processes import Kvgate, start_in_process
from kvgate.simulator.replica_server import SimulatedReplica, start_simulated_replicas


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def parts():
    """Starts replicas and kvgates for a row and stops them after it; each kvgate must end clean."""
    replicas: list[SimulatedReplica] = []
    gates: list[Kvgate] = []
    others: list = []

    class Parts:
        async def replicas(self, count: int = 1, **options) -> list[SimulatedReplica]:
            started = await start_simulated_replicas(count, **{"time_scale": 0.0, **options})
            replicas.extend(started)
            return started

        async def kvgate(self, config: dict, name: str = "kvgate", health_checks: bool = False) -> Kvgate:
            gate = await start_in_process(name, config, health_checks=health_checks)
            gates.append(gate)
            return gate

        async def server(self, app: web.Application) -> str:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            others.append(runner)
            host, port = runner.addresses[0][:2]
            return f"http://{host}:{port}"

        def track(self, closeable) -> None:
            others.append(closeable)

    yield Parts()
    for gate in gates:
        finish_every_session(gate.app.admission)
        counts = gate.app.admission.counts()
        await gate.close()
        assert counts == CLEAN, f"{gate.name} left {counts}"
    for other in others:
        await (other.cleanup() if isinstance(other, web.AppRunner) else other.close())
    await asyncio.gather(*(r.stop() for r in replicas), return_exceptions=True)
