"""A relay between an agent client and kvgate that records every request the client
sends and the status kvgate answered: kvgate's access log has a line per forwarded
request only, so a request kvgate itself refuses before forwarding (an unknown route's
404) shows here and nowhere else."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
from aiohttp import web

# Hop-by-hop and framing headers: the relay's own connections set them.
_DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    status: int
    max_tokens: int | None = None  # the body's max_tokens (its output cap), if it is JSON and has one


def _max_tokens(body: bytes) -> int | None:
    try:
        document = json.loads(body)
    except ValueError:
        return None
    value = document.get("max_tokens") if isinstance(document, dict) else None
    return value if isinstance(value, int) else None


@asynccontextmanager
async def recording_relay(target: str) -> AsyncIterator[tuple[str, list[Request]]]:
    """(URL of a relay on loopback to `target`, the requests it relayed so far, in order).
    Bodies and answers pass unchanged, answers streamed as they come."""
    requests: list[Request] = []
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    async def relay(request: web.Request) -> web.StreamResponse:
        headers = {key: value for key, value in request.headers.items() if key.lower() not in _DROPPED}
        body = await request.read()
        async with http.request(request.method, target + request.path_qs, headers=headers, data=body) as upstream:
            requests.append(Request(request.method, request.path, upstream.status, _max_tokens(body)))
            answer = web.StreamResponse(
                status=upstream.status,
                headers={key: value for key, value in upstream.headers.items() if key.lower() not in _DROPPED},
            )
            await answer.prepare(request)
            async for chunk in upstream.content.iter_any():
                await answer.write(chunk)
            await answer.write_eof()
            return answer

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", requests
    finally:
        await runner.cleanup()
        await http.close()
