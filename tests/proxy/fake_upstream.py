"""A fake vLLM replica for the proxy's tests (never used in production code).

Answers the OpenAI/Anthropic routes the proxy forwards, streaming and not, plus
/health and /metrics, names itself in every answer (`x-fake-replica` header and the
content), records what it received, and has knobs to misbehave:

  mode = "ok" | "status500" | "close_mid_stream" | "truncate_body" | "slow"
  healthy = False  -> /health answers 503
  await refuse()   -> stop listening (connections are refused)
"""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web


class FakeUpstream:
    def __init__(self, name: str, chunks: int = 5, slow_sec: float = 5.0) -> None:
        self.name = name
        self.mode = "ok"
        self.healthy = True
        self.chunks = chunks
        self.chunk_delay = 0.0  # seconds between stream chunks
        self.slow_sec = slow_sec
        self.requests: list[dict] = []  # {"path", "headers", "body"}
        self.cancelled = 0  # handlers cancelled because the proxy dropped the connection
        self.cancelled_event = asyncio.Event()
        self.url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None

    # ---- lifecycle ---------------------------------------------------------------

    async def start(self, port: int = 0) -> FakeUpstream:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"):
            app.router.add_post(path, self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def refuse(self) -> None:
        """Stop listening and drop every connection: new connections are refused."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    stop = refuse

    # ---- handlers ----------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503, text="ok" if self.healthy else "down")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.1\n")

    async def _models(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": None})
        return web.json_response(
            {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": self.name, "created": 0}]},
            headers={"x-fake-replica": self.name},
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancelled_event.set()
            raise

    async def _answer(self, request: web.Request, body: dict) -> web.StreamResponse:
        if self.mode == "slow":
            await asyncio.sleep(self.slow_sec)
        if self.mode == "status500":
            return web.json_response(
                {"error": {"message": f"{self.name} exploded", "type": "server_error", "code": "internal"}},
                status=500,
                headers={"x-fake-replica": self.name},
            )
        kind = request.path.rsplit("/", 1)[-1]
        if self.mode == "truncate_body":  # announces 1000 bytes, sends 10, hangs up
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = 1000
            await response.prepare(request)
            await response.write(b'{"id": "x"')
            request.transport.close()
            return response
        if not body.get("stream"):
            return web.Response(
                body=orjson.dumps(self._full(kind, body)),
                content_type="application/json",
                headers={"x-fake-replica": self.name},
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-fake-replica": self.name})
        await response.prepare(request)
        for i in range(self.chunks):
            await response.write(self._chunk(kind, i, body))
            if self.mode == "close_mid_stream" and i == 1:
                request.transport.close()  # abrupt: no terminating chunk
                return response
            await asyncio.sleep(self.chunk_delay)
        await response.write(self._chunk(kind, -1, body))
        if kind != "messages":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ---- bodies ------------------------------------------------------------------

    def _full(self, kind: str, body: dict) -> dict:
        text = f"hello from {self.name}"
        usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        model = body.get("model", "fake-model")
        if kind == "completions" and "messages" in body:  # chat
            return {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": usage,
            }
        if kind == "completions":
            return {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
                "usage": usage,
            }
        if kind == "messages":
            return {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": "end_turn",
                "usage": {"input_tokens": 3, "output_tokens": 4},
            }
        return {
            "id": "resp_1",
            "object": "response",
            "model": model,
            "status": "completed",
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
        }

    def _chunk(self, kind: str, i: int, body: dict) -> bytes:
        model = body.get("model", "fake-model")
        last = i < 0
        piece = "" if last else (f"{self.name}" if i == 0 else f" t{i}")
        if kind == "completions" and "messages" in body:
            data = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": piece} if not last else {},
                        "finish_reason": "stop" if last else None,
                    }
                ],
            }
        elif kind == "completions":
            data = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": model,
                "choices": [{"index": 0, "text": piece, "finish_reason": "stop" if last else None, "logprobs": None}],
            }
        elif kind == "messages":
            event = "message_stop" if last else "content_block_delta"
            data = (
                {"type": event} if last else {"type": event, "index": 0, "delta": {"type": "text_delta", "text": piece}}
            )
            return f"event: {event}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"
        else:
            data = {"type": "response.completed" if last else "response.output_text.delta", "delta": piece}
        return b"data: " + orjson.dumps(data) + b"\n\n"
