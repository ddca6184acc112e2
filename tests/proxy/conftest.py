"""Fixtures of the proxy tests: fake replicas and a proxy app in front of them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import aiohttp
import pytest
from fake_upstream import FakeUpstream

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import AdminSettings, Settings

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture
async def upstreams():
    """Two fake replicas, r0 and r1, stopped after the test."""
    fakes = [await FakeUpstream("r0").start(), await FakeUpstream("r1").start()]
    yield fakes
    for fake in fakes:
        await fake.stop()


def proxy_settings(fakes, **overrides) -> Settings:
    """Settings for forwarding tests: the gate is off (gate tests live in tests/gate)."""
    base = Settings(
        replicas=tuple(ReplicaSettings(f.name, f.url) for f in fakes),
        admin=AdminSettings(token=ADMIN_TOKEN),
        gate=GateSettings(mode="off"),
    )
    return dataclasses.replace(base, **overrides)


class ProxyClient:
    """A started proxy app and an aiohttp ClientSession pointed at it.

    `await client.post(path, ...)` etc. return aiohttp ClientResponses; `client.app` is
    the ProxyApp (registry, sessions, ...); `client.server.host/.port` its address.
    """

    def __init__(self, app, host: str, port: int) -> None:
        self.app = app
        self.server = SimpleNamespace(host=host, port=port)
        self.session = aiohttp.ClientSession(base_url=f"http://{host}:{port}")

    def request(self, method: str, path: str, **kwargs):
        return self.session.request(method, path, **kwargs)

    def get(self, path: str, **kwargs):
        return self.session.get(path, **kwargs)

    def post(self, path: str, **kwargs):
        return self.session.post(path, **kwargs)

    def delete(self, path: str, **kwargs):
        return self.session.delete(path, **kwargs)

    async def close(self) -> None:
        await self.session.close()
        await self.app.close()


@pytest.fixture
async def make_proxy():
    """make_proxy(fakes, admission=None, **settings_overrides) -> ProxyClient (closed after the test)."""
    clients: list[ProxyClient] = []

    async def make(fakes, admission=None, **overrides):
        app = create_app(proxy_settings(fakes, **overrides), admission=admission, health_checks=False)
        host, port = await app.start("127.0.0.1", 0)
        client = ProxyClient(app, host, port)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def proxy(upstreams, make_proxy):
    return await make_proxy(upstreams)
