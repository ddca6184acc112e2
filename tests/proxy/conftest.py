"""Fixtures of the proxy tests: fake replicas and a proxy app in front of them (proxy_client.py)."""

from __future__ import annotations

import pytest
from fake_upstream import FakeUpstream
from proxy_client import ProxyClient, proxy_settings

from kvgate.proxy.app import create_app


@pytest.fixture
async def upstreams():
    """Two fake replicas, r0 and r1, stopped after the test."""
    fakes = [await FakeUpstream("r0").start(), await FakeUpstream("r1").start()]
    yield fakes
    for fake in fakes:
        await fake.stop()


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
