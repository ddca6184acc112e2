"""A scripted chat-completions server for the benchmark driver's tests.

`ScriptedReplica` streams OpenAI-shaped chat completions like a replica behind kvgate
(with the `x-kvgate-*` headers) and records every request. With `supersede=True` it
behaves like a gate with attempt supersession: an attempt is held until a newer attempt
of the same session arrives, which answers the held one 409 `admission_superseded`.
`never_answer` lists (session id, turn) attempts that hang forever (a stranded waiter).
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web


class ScriptedReplica:
    def __init__(self, supersede: bool = False, never_answer: set | None = None) -> None:
        self.supersede = supersede
        self.never_answer = never_answer or set()
        self.requests: list[tuple[dict, dict]] = []  # (headers, body)
        self._held: dict[str, asyncio.Future] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        headers = dict(request.headers)
        self.requests.append((headers, body))
        session = request.headers["x-session-id"]
        turn = (len(body["messages"]) - 2) // 2 + 1
        if (session, turn) in self.never_answer:
            await asyncio.Event().wait()
        older = self._held.pop(session, None)
        if older is not None and not older.done():
            older.set_result("superseded")
        if self.supersede:
            held = asyncio.get_running_loop().create_future()
            self._held[session] = held
            try:
                outcome = await asyncio.wait_for(held, timeout=0.3)
            except TimeoutError:
                outcome = "admitted"
            if self._held.get(session) is held:
                del self._held[session]
            if outcome == "superseded":
                return web.json_response(
                    {
                        "error": {
                            "message": "a newer attempt arrived",
                            "type": "conflict",
                            "code": "admission_superseded",
                        }
                    },
                    status=409,
                )
        resp = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "x-kvgate-replica": "r0",
                "x-kvgate-admission": "open",
                "x-kvgate-wait-ms": "1.5",
            }
        )
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"delta": {"content": f" w{turn}x{i}"}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": body["max_tokens"]}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp
