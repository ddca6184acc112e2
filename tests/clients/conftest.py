"""Fixtures for the real-client tests: `kvgate serve` on the embedded default, access log on."""

from __future__ import annotations

import pytest

from kvgate.bench.processes import ServerGroup


@pytest.fixture
async def embedded_kvgate(tmp_path):
    """(URL, log path) of `kvgate serve` with no replicas configured (two simulated
    replicas in-process, the defaults a new user gets) and the access log on."""
    async with ServerGroup(tmp_path / "logs") as servers:
        url = await servers.serve(
            "kvgate", lambda port: {"listen": {"host": "127.0.0.1", "port": port}, "log": {"access": True}}
        )
        yield url, tmp_path / "logs" / "kvgate.log"
