"""Fixtures for the real-client tests: `kvgate serve` on the embedded default, access log on."""

from __future__ import annotations

import pytest
from client_harness import ADMIN_TOKEN
from request_recorder import recording_relay

from kvgate.bench.processes import ServerGroup


@pytest.fixture
async def embedded_kvgate(tmp_path):
    """(URL, log path) of `kvgate serve` with no replicas configured (two simulated
    replicas in-process, the defaults a new user gets) and the access log on (docs/clients.md).

    gate.quiet_floor_sec 10: an idle window lasts at least 10 s, so a session's window
    outlasts a new client process starting or a loaded machine's pause between turns
    (by default it may end after 0.5 s until the session's gap between turns is known)."""
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "log": {"access": True},
        "gate": {"quiet_floor_sec": 10},
        "admin": {"token": ADMIN_TOKEN},  # the tests read the gates' books (client_harness.gate_sessions)
    }
    async with ServerGroup(tmp_path / "logs") as servers:
        url = await servers.serve("kvgate", lambda port: {**config, "listen": {"host": "127.0.0.1", "port": port}})
        yield url, tmp_path / "logs" / "kvgate.log"


@pytest.fixture
async def recorded_kvgate(embedded_kvgate):
    """(URL, log path, requests) of `embedded_kvgate` behind a relay that records every
    request the client sends and kvgate's status for it (request_recorder.py)."""
    url, log_path = embedded_kvgate
    async with recording_relay(url) as (relay_url, requests):
        yield relay_url, log_path, requests
