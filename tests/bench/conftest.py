"""Fixtures of the benchmark tests (the scripted server is in scripted_replica.py)."""

from __future__ import annotations

import pytest
from scripted_replica import ScriptedReplica


@pytest.fixture
async def scripted_replica(aiohttp_server):
    """scripted_replica(**options) -> (ScriptedReplica, base URL); servers close after the test."""

    async def start(**options):
        replica = ScriptedReplica(**options)
        server = await aiohttp_server(replica.app())
        return replica, str(server.make_url("")).rstrip("/")

    return start
