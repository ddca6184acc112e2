"""A kvgate with a real gate in front of scripted fake replicas, for the status page's tests.

The replicas (tests/gate/fake_replica.py) answer the probe API as the test scripts it, so
a test decides when a turn waits and when it goes in; they also answer /health, so the
health rounds run and mirror their /metrics (the page's hit rate). Everything runs on
loopback on the caller's event loop; `Stack.close()` stops all of it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvgate.balancer.settings import BalancerSettings, HealthSettings, ReplicaSettings
from kvgate.gate.admission import AdmissionController
from kvgate.gate.settings import ProbeSettings
from kvgate.proxy.app import ProxyApp, create_app
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.settings import AdminSettings, Settings
from tests.gate.fake_replica import ReplicaScript, fake_replica_app
from tests.gate.helpers import CLEAN, settings

TOKEN = "ui-test-token"
ROOMY = {"version": 1, "kv_cache_usage": 0.1, "num_total_blocks": 100, "num_free_blocks": 90, "block_size": 16}
CROWDED = {"version": 1, "kv_cache_usage": 1.0, "num_total_blocks": 100, "num_free_blocks": 0, "block_size": 16}


def replica_metrics_text(hits: int, queries: int) -> str:
    return (
        f"vllm:prefix_cache_queries_total {queries}\nvllm:prefix_cache_hits_total {hits}\nvllm:num_requests_running 1\n"
    )


@dataclass
class Stack:
    scripts: dict[str, ReplicaScript]
    replica_urls: dict[str, str]
    runners: list[web.AppRunner]
    app: ProxyApp
    controller: AdmissionController
    url: str
    port: int

    async def restart(self) -> None:
        """Stop kvgate and start a new one (fresh books) on the same port."""
        await self.app.close()
        self.app, self.controller = _kvgate(self.replica_urls)
        await self.app.start("127.0.0.1", self.port)

    async def close(self) -> None:
        await self.app.close()
        for runner in self.runners:
            await runner.cleanup()
        assert self.controller.counts() == CLEAN, self.controller.counts()


def _kvgate(replica_urls: dict[str, str]) -> tuple[ProxyApp, AdmissionController]:
    gate = settings(
        policy="watermark",
        wait_poll_sec=0.2,
        max_wait_sec=120,
        idle_grace_sec=30,
        quiet_floor_sec=30,
        probe=ProbeSettings(timeout_sec=1.0, usage_max_age_ms=0),
    )
    metrics = KvgateMetrics()
    controller = AdmissionController(gate, metrics.gate)
    app = create_app(
        Settings(
            gate=gate,
            replicas=tuple(ReplicaSettings(name, url) for name, url in replica_urls.items()),
            admin=AdminSettings(token=TOKEN),
            balancer=BalancerSettings(health=HealthSettings(interval_sec=1.0)),
        ),
        metrics=metrics,
        admission=controller,
        health_checks=True,
    )
    return app, controller


async def _replica(script: ReplicaScript) -> tuple[web.AppRunner, str]:
    app = fake_replica_app(script)

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def start_stack(names: tuple[str, ...] = ("r0", "r1")) -> Stack:
    scripts, urls, runners = {}, {}, []
    for name in names:
        script = ReplicaScript(kv=dict(ROOMY), metrics_text=replica_metrics_text(0, 0))
        runner, url = await _replica(script)
        scripts[name], urls[name] = script, url
        runners.append(runner)
    app, controller = _kvgate(urls)
    host, port = await app.start("127.0.0.1", 0)
    return Stack(scripts, urls, runners, app, controller, f"http://{host}:{port}", port)


async def read_replica_metrics(stack: Stack) -> None:
    """One round of kvgate's /metrics mirror now, instead of waiting for the health loop's."""
    async with aiohttp.ClientSession() as http:
        await stack.app.replica_metrics.read_all(http)


async def crowd(stack: Stack, crowded: bool) -> None:
    """Every replica reports a full KV cache (a cold turn then waits, watermark policy) or a
    roomy one; returns once the gates' cached readings are too old to be used unrefreshed
    (gate/probe.py: usage_max_age_ms 0 + timeout_sec)."""
    for script in stack.scripts.values():
        script.kv = dict(CROWDED if crowded else ROOMY)
    await asyncio.sleep(1.1)


async def turn(url: str, session: str, finish: bool = False, timeout: float = 30) -> tuple[int, dict[str, str]]:
    """One chat turn of `session` through kvgate; its status and the response headers."""
    headers = {"x-session-id": session}
    if finish:
        headers["x-session-finish"] = "true"
    body = {"model": "m", "messages": [{"role": "user", "content": f"next turn of {session}"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{url}/v1/chat/completions", json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            await resp.read()
            return resp.status, dict(resp.headers)


async def admin(url: str, method: str, path: str, token: str | None = TOKEN) -> tuple[int, dict, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, f"{url}{path}", headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
