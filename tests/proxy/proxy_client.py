"""A proxy app under test and a client pointed at it: the settings the forwarding tests
use (the gate off, the admin API on with ADMIN_TOKEN) and `ProxyClient`."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import aiohttp

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.settings import AdminSettings, Settings

ADMIN_TOKEN = "test-admin-token"


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
