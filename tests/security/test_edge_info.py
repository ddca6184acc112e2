"""Security conformance, the third red-team pass, finding 9 (info): a client resetting
the simulated replica's stream logs no traceback, and a client that leaves kvgate before
the replica's headers arrive is counted as a disconnect."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import ClientConnectionResetError, web
from security_parts import chat, until

from kvgate.simulator.replica_server import build_replica_app


async def test_e9_a_client_reset_mid_stream_logs_no_traceback_on_the_simulated_replica(parts, http, caplog):
    app = build_replica_app(time_scale=0.0)

    async def streams_to_a_reset_client(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        raise ClientConnectionResetError("Cannot write to closing transport")  # what a write after a reset raises

    app.router.add_get("/reset", streams_to_a_reset_client)
    url = await parts.server(app)
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        try:
            async with http.get(url + "/reset") as resp:
                await resp.read()
        except Exception:
            pass  # the answer is broken off either way; what matters is the replica's log
    assert not [r for r in caplog.records if r.exc_info or "Error handling request" in r.getMessage()]


async def test_e9_a_client_gone_before_the_upstream_headers_counts_as_a_disconnect(parts, http):
    started, release = asyncio.Event(), asyncio.Event()

    async def slow_head(request: web.Request) -> web.Response:
        started.set()
        await release.wait()  # the client leaves before this
        return web.json_response({})

    upstream = web.Application()
    upstream.router.add_post("/v1/chat/completions", slow_head)
    url = await parts.server(upstream)
    gate = await parts.kvgate({"replicas": [{"name": "r", "url": url}], "gate": {"mode": "off"}})
    counter = gate.app.metrics.upstream_errors.labels("r", "client_disconnect")
    before = counter._value.get()
    request = asyncio.ensure_future(http.post(gate.url + "/v1/chat/completions", json=chat()))
    await asyncio.wait_for(started.wait(), 10)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    try:
        await until(lambda: counter._value.get() == before + 1, "the disconnect to be counted")
    finally:
        release.set()
