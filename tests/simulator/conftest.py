"""Fixtures for the simulator's tests: a small engine config and a replica test client."""

from __future__ import annotations

import pytest

from kvgate.simulator.config import EngineConfig
from kvgate.simulator.replica_server import build_replica_app


@pytest.fixture
def replica_client(aiohttp_client):
    """Factory: `await replica_client(num_blocks=..., time_scale=...)` -> aiohttp test client.

    The runner cancels handlers on client disconnect, as SimulatedReplica's does.
    """

    async def make(time_scale: float = 0.0, **config):
        app = build_replica_app(EngineConfig(**config), time_scale=time_scale)
        return await aiohttp_client(app, server_kwargs={"handler_cancellation": True})

    return make
