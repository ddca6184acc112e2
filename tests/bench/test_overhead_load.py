"""The overhead benchmark's load generator against a real loopback server: `--rate` paces
its workers (no timing assert: pacing only bounds how many requests go out), and a
session's requests take its threads' histories in turn (`--body-threads`)."""

from __future__ import annotations

import orjson
from aiohttp import web

from kvgate.bench.overhead_load import pacing_interval, run

ANSWER = b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'


async def answer(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")


async def test_a_paced_run_never_sends_faster_than_its_rate(aiohttp_server):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    server = await aiohttp_server(app)
    url = f"http://127.0.0.1:{server.port}"
    paced = await run(url, 4, duration=1.0, warmup=0.0, stream=False, sessions=8, rate=20.0)
    # each of the 4 workers sends at most one request per 0.2 s, its first at once
    assert 1 <= paced["requests"] <= 20 * 1.0 + 4
    assert paced["errors"] == 0


def test_the_workers_with_sessions_share_the_whole_rate():
    assert pacing_interval(4, 20.0) == 0.2
    # fewer sessions than clients (2 of 16 workers have one): those 2 send the whole rate
    assert pacing_interval(2, 20.0) == 0.1
    assert pacing_interval(16, None) == 0.0


async def test_a_run_without_a_rate_is_closed_loop(aiohttp_server):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    server = await aiohttp_server(app)
    result = await run(f"http://127.0.0.1:{server.port}", 2, duration=0.3, warmup=0.0, stream=False, sessions=4)
    assert result["requests"] > 0 and result["errors"] == 0


async def test_each_sessions_requests_take_its_threads_in_turn(aiohttp_server):
    """`--body-threads 2`: one session's requests alternate between two histories that differ
    in their first message (a main agent and its subagent under one session id)."""
    seen: list[tuple[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        seen.append((request.headers["x-session-id"], body["messages"][0]["content"]))
        return await answer(request)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", record)
    server = await aiohttp_server(app)
    url = f"http://127.0.0.1:{server.port}"
    primed = await run(url, 1, 0.0, 0.0, False, sessions=2, prime=True, body_kib=4, body_threads=2)
    assert primed["requests"] == 4 and primed["errors"] == 0
    assert [session for session, _ in seen] == ["bench-0", "bench-0", "bench-1", "bench-1"]
    assert seen[0][1] != seen[1][1] and (seen[0][1], seen[1][1]) == (seen[2][1], seen[3][1])
