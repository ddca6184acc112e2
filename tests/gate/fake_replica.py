"""A small aiohttp replica whose probe answers the test controls (docs/reference.md).

It also answers POST /v1/chat/completions at once with a fixed reply, so a proxy can
forward to it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class ReplicaScript:
    """What the fake replica answers. Set a `*_raw` to answer bytes instead of JSON."""

    kv: Any = field(
        default_factory=lambda: {
            "version": 1,
            "kv_cache_usage": 0.1,
            "num_total_blocks": 100,
            "num_free_blocks": 90,
            "block_size": 16,
        }
    )
    kv_status: int = 200
    kv_raw: bytes | None = None
    kv_delay: float = 0.0
    has_probe_api: bool = True
    metrics_text: str = 'vllm:kv_cache_usage_perc{engine="0"} 0.42\n'
    prefix_by_id: dict[str, dict] = field(default_factory=dict)  # by body["id"], else body["session_id"]
    prefix_status: int = 200
    prefix_raw: bytes | None = None
    prefix_delay: float = 0.0
    # what it saw
    kv_hits: int = 0
    metrics_hits: int = 0
    prefix_requests: list[dict] = field(default_factory=list)
    chat_requests: list[dict] = field(default_factory=list)
    authorization: list[str | None] = field(default_factory=list)

    def usage(self, value: float) -> None:
        self.kv = {**self.kv, "kv_cache_usage": value}

    def prefix(self, body_id: str, total: int, hit: int) -> None:
        self.prefix_by_id[body_id] = {
            "version": 1,
            "total_tokens": total * 16,
            "total_blocks": total,
            "hit_blocks": hit,
            "hit_tokens": hit * 16,
            "hit_ratio": hit / total if total else 0.0,
        }


def fake_replica_app(script: ReplicaScript) -> web.Application:
    async def kv(request: web.Request) -> web.Response:
        script.kv_hits += 1
        script.authorization.append(request.headers.get("Authorization"))
        if not script.has_probe_api:
            raise web.HTTPNotFound()
        if script.kv_delay:
            await asyncio.sleep(script.kv_delay)
        body = script.kv_raw if script.kv_raw is not None else orjson.dumps(script.kv)
        return web.Response(body=body, status=script.kv_status, content_type="application/json")

    async def prefix(request: web.Request) -> web.Response:
        if not script.has_probe_api:
            raise web.HTTPNotFound()
        doc = orjson.loads(await request.read())
        script.prefix_requests.append(doc)
        if script.prefix_delay:
            await asyncio.sleep(script.prefix_delay)
        if script.prefix_raw is not None:
            return web.Response(body=script.prefix_raw, status=script.prefix_status, content_type="application/json")
        inner = next(iter(doc.values()))
        body_id = inner.get("id") or inner.get("session_id") or ""
        answer = script.prefix_by_id.get(body_id, {"total_blocks": 10, "hit_blocks": 0, "hit_ratio": 0.0})
        return web.Response(body=orjson.dumps(answer), status=script.prefix_status, content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        script.metrics_hits += 1
        return web.Response(text=script.metrics_text)

    async def chat(request: web.Request) -> web.Response:
        doc = orjson.loads(await request.read())
        script.chat_requests.append(doc)
        answer = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": doc.get("model", "m"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/kvgate/kv", kv)
    app.router.add_post("/v1/kvgate/prefix", prefix)
    app.router.add_get("/metrics", metrics)
    return app
