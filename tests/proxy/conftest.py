"""Fixtures of the proxy tests: fake replicas and a proxy app in front of them."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.app import create_app
from proxy.settings import AdminSettings, LimitsSettings, ReplicaSettings, Settings
from fake_upstream import FakeUpstream

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture
async def upstreams():
    """Two fake replicas, r0 and r1, stopped after the test."""
    fakes = [await FakeUpstream("r0").start(), await FakeUpstream("r1").start()]
    yield fakes
    for fake in fakes:
        await fake.stop()


def proxy_settings(fakes, **overrides) -> Settings:
    base = Settings(replicas=tuple(ReplicaSettings(f.name, f.url) for f in fakes),
                    admin=AdminSettings(token=ADMIN_TOKEN))
    return dataclasses.replace(base, **overrides)


@pytest.fixture
async def make_proxy(aiohttp_client):
    """make_proxy(fakes, **settings_overrides, admission=None) -> aiohttp test client."""
    async def make(fakes, admission=None, **overrides):
        app = create_app(proxy_settings(fakes, **overrides), admission=admission, health_checks=False)
        return await aiohttp_client(app)
    return make


@pytest.fixture
async def proxy(upstreams, make_proxy):
    return await make_proxy(upstreams)


def small_body_limit(n: int) -> LimitsSettings:
    return LimitsSettings(max_body_bytes=n)
