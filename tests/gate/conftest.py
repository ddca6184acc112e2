"""Fixtures of the gate's tests (the helpers they use are in helpers.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from kvgate.gate.gate import Gate
from kvgate.gate.metrics import GateMetrics
from tests.gate.fake_replica import ReplicaScript, fake_replica_app
from tests.gate.helpers import CLEAN, FakeClock, FakeProbe


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def loop_on_clock(clock: FakeClock):
    """The event loop's timers follow the test's FakeClock: a gate's waits (its poll, a
    recheck, max_wait_sec) end when the test advances the clock, never in real time.
    For tests of logic only: a real HTTP client or server on the same loop would see
    its timeouts frozen too."""
    loop = asyncio.get_running_loop()
    loop.time = clock  # type: ignore[method-assign]  # the instance attribute shadows BaseEventLoop.time
    yield clock
    del loop.time


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


# ------------------------------------------------- every gate a test makes ends clean


@pytest.fixture(autouse=True)
def gates_end_clean(monkeypatch):
    """After each test, every Gate it made holds no lease, window, waiter, attempt or
    session once its windows expire (its FakeClock is moved past the grace)."""
    made: list[Gate] = []
    real_init = Gate.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Gate, "__init__", recording_init)
    yield
    for gate in made:
        clock = gate._now
        if isinstance(clock, FakeClock):
            clock.advance(gate.settings.idle_grace_sec + 1)
        assert gate.counts() == CLEAN, (gate.name, gate.counts())
