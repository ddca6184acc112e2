"""Fixtures of the gate's tests (the helpers they use are in helpers.py)."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from kvgate.gate.metrics import GateMetrics
from tests.gate.fake_replica import ReplicaScript, fake_replica_app
from tests.gate.helpers import FakeClock, FakeProbe


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics() -> GateMetrics:
    return GateMetrics(CollectorRegistry())


@pytest.fixture
def probe() -> FakeProbe:
    return FakeProbe()


# ---------------------------------------------------- a fake replica over real HTTP


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def script():
    return ReplicaScript()


@pytest.fixture
async def replica_url(aiohttp_server, script):
    server = await aiohttp_server(fake_replica_app(script), host="127.0.0.1")
    return str(server.make_url("")).rstrip("/")
