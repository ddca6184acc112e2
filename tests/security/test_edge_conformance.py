"""Security conformance, the third red-team pass (a keyed deployment's HTTP edge): one row
per finding, each playing the attack as it was reproduced against real parts on loopback
(kvgate apps, `kvgate replica`'s app, aiohttp clients and raw sockets). `e1_...` is
finding 1 of that pass. Every row failed on the code before these fixes and passes now.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from security_parts import address_of, chat, raw_exchange, replica_config, until
from yarl import URL

CLIENT_KEY = "tenant-a-key-Lm40"
OTHER_KEY = "tenant-b-key-Qz83"
KEYED = {"auth": {"api_keys": [CLIENT_KEY, OTHER_KEY]}}
TENANT_B = {"Authorization": f"Bearer {OTHER_KEY}"}


def raw(base: str, path: str) -> URL:
    """`path` exactly as written: aiohttp would otherwise decode and normalise it."""
    return URL(base + path, encoded=True)


# ---- finding 2: percent-encoded paths reached the replica API ------------------------------

# The replica API's routes, disguised: each decodes or normalises to /v1/kvgate/... on a
# replica's server or an intermediate.
DISGUISED = [
    ("GET", "/v1/%6bvgate/kv"),
    ("GET", "/v1/%6Bvgate/kv"),
    ("POST", "/v1/%6bvgate/prefix"),
    ("POST", "/v1/%6bvgate/owner"),
    ("GET", "/v1/kvgat%65/kv"),
    ("GET", "/%761/kvgate/kv"),
    ("GET", "/sess/x/v1/%6bvgate/kv"),
    ("POST", "/sess/x/v1/%6bvgate/owner"),
    ("GET", "/v1//kvgate/kv"),
    ("GET", "/v1/./kvgate/kv"),
    ("GET", "/v1/x/../kvgate/kv"),
    ("GET", "/v1/%2e%2e/v1/kvgate/kv"),
    ("GET", "/v1/x/%2E%2E/kvgate/kv"),
    ("GET", "/v1/x%2F..%2Fkvgate/kv"),
    ("GET", "/v1%2Fkvgate%2Fkv"),
    ("GET", "/sess/x//v1/kvgate/kv"),
    ("GET", "/sess/x/v1/x/../kvgate/kv"),
    ("GET", "/v1/%zzgate/kv"),
    ("GET", "/%68ealth"),
    ("GET", "/v1/%6dodels"),
]


async def test_e2_disguised_replica_api_paths_are_refused_before_auth_routing_and_forwarding(parts, http):
    (replica,) = await parts.replicas()  # no replica key: its API answers whoever reaches it
    gate = await parts.kvgate(replica_config(replica, **KEYED))
    answers = {}
    for method, path in DISGUISED:
        async with http.request(
            method, raw(gate.url, path), json={"gate_id": "b", "ttl_sec": 60}, headers=TENANT_B
        ) as r:
            answers[path] = (r.status, (await r.json())["error"].get("code"))
    assert answers == {path: (400, "non_canonical_path") for _, path in DISGUISED}
    # the owner claims never reached the replica: its record is free
    async with http.get(replica.url + "/v1/kvgate/owner") as resp:
        assert (await resp.json())["held"] is False


async def test_e2_canonical_paths_still_pass_including_escaped_session_ids(parts, http):
    (replica,) = await parts.replicas()
    gate = await parts.kvgate(replica_config(replica, **KEYED))
    async with http.post(raw(gate.url, "/sess/a%2Fb/v1/chat/completions"), json=chat(), headers=TENANT_B) as resp:
        assert resp.status == 200, await resp.text()
    async with http.get(raw(gate.url, "/v1/models/"), headers=TENANT_B) as resp:
        assert resp.status != 400  # a trailing '/' is a different path, not a disguised one
    async with http.get(raw(gate.url, "/v1/kvgate/kv"), headers=TENANT_B) as resp:
        assert resp.status == 404  # the plain replica API: never relayed, as before
    async with http.get(raw(gate.url, "/v1/%6bvgate/kv")) as resp:
        assert resp.status == 400  # refused alike without a key: nothing is learned either way


# ---- finding 1: the body was read before the key was checked -------------------------------

SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: k\r\nContent-Length: 1000000\r\n"


async def test_e1_no_key_gets_401_and_close_before_any_body_byte_and_before_100_continue(parts, http):
    (replica,) = await parts.replicas()
    gate = await parts.kvgate(replica_config(replica, **KEYED))
    # a 31 MB body announced, none of it sent: the answer comes at the head
    head = SLOW_HEAD.replace(b"1000000", b"31000000") + b"Expect: 100-continue\r\n\r\n"
    data, closed = await raw_exchange(gate.url, head, timeout=3)
    assert data.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in data and closed, data
    # the same with a byte of the body sent: nothing of it waits for the rest
    data, closed = await raw_exchange(gate.url, SLOW_HEAD + b"\r\n{", timeout=3)
    assert data.startswith(b"HTTP/1.1 401 ") and closed, data
    # a body to the open /health is a body without a key too
    data, closed = await raw_exchange(gate.url, b"POST /health HTTP/1.1\r\nHost: k\r\nContent-Length: 9\r\n\r\n", 3)
    assert data.startswith(b"HTTP/1.1 401 ") and closed, data


async def test_e1_anonymous_slow_sockets_cannot_take_every_slot(parts, http):
    (replica,) = await parts.replicas()
    gate = await parts.kvgate(replica_config(replica, limits={"max_connections": 20}, **KEYED))
    attackers = [await asyncio.open_connection(*address_of(gate.url)) for _ in range(20)]
    try:
        for _, writer in attackers:  # a head, one byte at a time: it never completes
            writer.write(SLOW_HEAD[:20])
        await until(lambda: len(gate.app._server.connections) == 20, "the 20 slow sockets to take every slot")
        async with http.get(gate.url + "/health") as resp:
            assert resp.status == 200
        headers = {**TENANT_B, "x-session-id": "keyed"}
        async with http.post(gate.url + "/v1/chat/completions", json=chat(), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    finally:
        for _, writer in attackers:
            writer.close()


async def test_e1_a_body_trickling_in_meets_a_total_deadline(parts, http):
    (replica,) = await parts.replicas()
    limits = {"body_timeout_sec": 5.0, "body_deadline_sec": 0.6}
    gate = await parts.kvgate(replica_config(replica, limits=limits, **KEYED))
    reader, writer = await asyncio.open_connection(*address_of(gate.url))
    try:
        writer.write(SLOW_HEAD + f"Authorization: Bearer {CLIENT_KEY}\r\n\r\n".encode())
        answer = b""
        for _ in range(40):  # a byte every 0.1 s: each read well within body_timeout_sec
            writer.write(b" ")
            try:
                answer = await asyncio.wait_for(reader.read(65536), 0.1)
                break
            except TimeoutError:
                continue
        assert answer.startswith(b"HTTP/1.1 408 ") and b"body_deadline_sec" in answer, answer
    finally:
        writer.close()


# ---- finding 6: learned usage was not clamped ---------------------------------------------

HUGE = 2**63 - 1


async def kv(_request: web.Request) -> web.Response:
    """A replica's kv answer: 100 blocks of 16 tokens, max_model_len 1024."""
    doc = {"version": 1, "kv_cache_usage": 0.1, "num_total_blocks": 100, "num_free_blocks": 90}
    return web.json_response({**doc, "block_size": 16, "max_model_len": 1024, "max_token_bytes": 16})


def hostile_replica() -> web.Application:
    """A replica that reports every prompt as 2^63-1 tokens."""

    async def chat_completions(request: web.Request) -> web.Response:
        await request.read()
        usage = {"prompt_tokens": HUGE, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": HUGE}}
        message = {"role": "assistant", "content": "ok"}
        return web.json_response({"id": "c", "choices": [{"index": 0, "message": message}], "usage": usage})

    app = web.Application()
    app.router.add_get("/v1/kvgate/kv", kv)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


async def test_e6_a_replica_reporting_huge_usage_cannot_poison_the_gate(parts, http):
    url = await parts.server(hostile_replica())
    gate = await parts.kvgate({"replicas": [{"name": "hostile", "url": url}]})
    for turn in range(3):
        body = chat("hello " * (turn + 1))
        async with http.post(gate.url + "/v1/chat/completions", json=body, headers={"x-session-id": "s"}) as resp:
            assert resp.status == 200, await resp.text()
    book = gate.app.admission._gates["hostile"]._book
    sizes = [record.prompt_tokens for record in book.records.values()]
    assert sizes and all(size is not None and 0 < size <= 1024 for size in sizes), sizes
    # the ratio learnt from those sizes is a few tokens per byte at most, not 2^63 over a body
    assert book.tokens_per_byte is not None and book.tokens_per_byte <= 16, book.tokens_per_byte


# ---- finding 5: the usage tap was unbounded, quadratic, and blind to CRLF -----------------


def streaming_replica(first: bytes, rest: bytes, release: asyncio.Event) -> web.Application:
    """A replica whose chat stream sends `first`, waits for `release`, then sends `rest`."""

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body.get("stream_options") == {"include_usage": True}  # kvgate asked for it
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        await release.wait()
        await resp.write(rest)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/kvgate/kv", kv)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


def sse_crlf(doc: dict) -> bytes:
    import orjson

    return b"data: " + orjson.dumps(doc) + b"\r\n\r\n"


async def read_at_least(resp, size: int, timeout: float = 10.0) -> bytes:
    data = b""
    async with asyncio.timeout(timeout):
        while len(data) < size:
            piece = await resp.content.read(1 << 20)
            if not piece:
                break
            data += piece
    return data


async def test_e5_crlf_events_pass_at_once_and_the_usage_event_kvgate_asked_for_is_taken_out(parts, http):
    content = sse_crlf({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]})
    usage = sse_crlf({"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}})
    release = asyncio.Event()
    url = await parts.server(streaming_replica(content, usage + b"data: [DONE]\r\n\r\n", release))
    gate = await parts.kvgate({"replicas": [{"name": "r", "url": url}]})
    body = chat(stream=True)
    async with http.post(gate.url + "/v1/chat/completions", json=body, headers={"x-session-id": "s"}) as resp:
        assert await read_at_least(resp, len(content), timeout=5) == content  # before the stream ends
        release.set()
        rest = await resp.read()
    assert rest == b"data: [DONE]\r\n\r\n"  # the usage event the client did not ask for is not relayed


async def test_e5_an_over_long_event_is_relayed_as_it_comes_not_held(parts, http):
    huge = b"data: " + b'{"choices":[{"index":0,"delta":{"content":"' + b"x" * (6 << 20)  # no end yet
    release = asyncio.Event()
    url = await parts.server(streaming_replica(huge, b'"}}]}\n\ndata: [DONE]\n\n', release))
    gate = await parts.kvgate({"replicas": [{"name": "r", "url": url}]})
    async with http.post(gate.url + "/v1/chat/completions", json=chat(stream=True), headers={"x-session-id": "s"}) as r:
        assert len(await read_at_least(r, len(huge))) >= len(huge)  # relayed before the event ends
        release.set()
        await r.read()


# ---- finding 7: trailers were merged into the headers --------------------------------------


def chunked_with_trailer(path: str, head: bytes, body: bytes, trailer: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\n".encode()
        + head
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n"
        + trailer
        + b"\r\n"
    )


async def test_e7_trailer_fields_are_neither_honoured_nor_forwarded(parts, http):
    import orjson

    seen: list[dict[str, str]] = []

    async def chat_completions(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        await request.read()
        return web.json_response({"id": "c", "choices": [{"index": 0, "message": {"role": "assistant"}}]})

    app = web.Application()
    app.router.add_get("/v1/kvgate/kv", kv)
    app.router.add_post("/v1/chat/completions", chat_completions)
    url = await parts.server(app)
    gate = await parts.kvgate({"replicas": [{"name": "r", "url": url}], **KEYED})
    body = orjson.dumps(chat())
    # a trailer Authorization does not authenticate
    raw_bytes = chunked_with_trailer(
        "/v1/chat/completions", b"", body, f"Authorization: Bearer {CLIENT_KEY}\r\n".encode()
    )
    data, _ = await raw_exchange(gate.url, raw_bytes, timeout=3)
    assert data.startswith(b"HTTP/1.1 401 "), data
    # a trailer session id neither names the session nor reaches the replica
    head = f"Authorization: Bearer {CLIENT_KEY}\r\nx-session-id: mine\r\nConnection: close\r\n".encode()
    trailer = b"x-session-id: victim\r\nx-kvgate-session-id: victim\r\nx-smuggled: 1\r\n"
    data, _ = await raw_exchange(gate.url, chunked_with_trailer("/v1/chat/completions", head, body, trailer), 3)
    assert data.startswith(b"HTTP/1.1 200 "), data
    (headers,) = seen
    assert headers.get("x-session-id") == "mine" and "x-smuggled" not in headers
    assert "victim" not in str(headers) and "victim" not in str(gate.app.admission.state())


# ---- findings 3 and 4: tenants (client keys) shared session ids and Responses links ----------

TENANT_A = {"Authorization": f"Bearer {CLIENT_KEY}"}


async def test_e4_a_tenant_cannot_probe_finish_or_share_another_tenants_session(parts, http):
    (replica,) = await parts.replicas(num_blocks=512, block_size=16)
    gate = await parts.kvgate(replica_config(replica, **KEYED))

    async def turn(headers: dict, **extra) -> str:
        all_headers = {**headers, "x-session-id": "alpha", **extra}
        async with http.post(gate.url + "/v1/chat/completions", json=chat(), headers=all_headers) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["x-kvgate-admission"]

    await turn(TENANT_A)
    assert await turn(TENANT_A) == "holds_window"  # A's own session holds its window
    # B guesses A's id: a session of its own, so the admission says nothing of A's
    assert await turn(TENANT_B) != "holds_window"
    await turn(TENANT_B, **{"x-session-finish": "true"})  # B ends "alpha": its own
    assert await turn(TENANT_A) == "holds_window"  # A's window is still there
    sessions = list(gate.app.admission.state()[replica.name]["sessions"])
    assert "alpha" not in sessions and all(s.endswith(":alpha") for s in sessions), sessions


async def test_e3_responses_ids_and_stored_responses_belong_to_their_tenant(parts, http):
    replicas = await parts.replicas(2)
    config = {"replicas": [{"name": r.name, "url": r.url} for r in replicas], **KEYED}
    gate = await parts.kvgate(config)

    async def respond(headers: dict, session: str, status: int = 200, **fields) -> dict:
        body = {"model": "kvgate-sim", "input": f"{session} says hi", "max_output_tokens": 4, **fields}
        async with http.post(gate.url + "/v1/responses", json=body, headers={**headers, "x-session-id": session}) as r:
            assert r.status == status, await r.text()
            return await r.json()

    # B records "turn-1" first; A's continuation of "turn-1" does not join B's conversation
    await respond(TENANT_B, "b-session", request_id="turn-1")
    refused = await respond(TENANT_A, "a-session", 404, previous_response_id="turn-1")
    assert refused["error"]["code"] == "response_not_found"
    # nor may A store a response under B's id: 409 before forwarding
    refused = await respond(TENANT_A, "a-session", 409, request_id="turn-1")
    assert refused["error"]["code"] == "response_id_taken"
    # A's stored response: readable by A, not by B (not even told it exists)
    mine = await respond(TENANT_A, "a-session")
    async with http.get(gate.url + f"/v1/responses/{mine['id']}", headers=TENANT_B) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "response_not_found"
    async with http.get(gate.url + "/v1/responses/resp_never_made", headers=TENANT_B) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "response_not_found"
    async with http.get(gate.url + f"/v1/responses/{mine['id']}", headers=TENANT_A) as resp:
        assert resp.status == 200, await resp.text()
    # and A continues its own chain as before
    await respond(TENANT_A, "a-session", previous_response_id=mine["id"])


async def test_e4_a_tenant_cannot_supersede_another_tenants_waiting_turn(parts, http):
    from kvgate.proxy.tenancy import scoped_session, tenant_tag

    (replica,) = await parts.replicas(num_blocks=40, block_size=16)
    gate = await parts.kvgate(replica_config(replica, gate={"mode": "enforce", "policy": "working_set"}, **KEYED))
    waiters = gate.app.admission.counts
    big = "x " * 500

    async def post(headers: dict, session: str, text: str) -> int:
        all_headers = {**headers, "x-session-id": session}
        async with http.post(gate.url + "/v1/chat/completions", json=chat(text), headers=all_headers) as resp:
            return resp.status

    assert await post(TENANT_A, "filler", big) == 200  # A's window fills the replica
    first = asyncio.ensure_future(post(TENANT_A, "agent", "agent " + big))
    await until(lambda: waiters()["waiters"] == 1, "A's turn to wait at the gate")
    # B re-sends A's very turn under A's session id: on one namespace it superseded A's (409)
    second = asyncio.ensure_future(post(TENANT_B, "agent", "agent " + big))
    await until(lambda: waiters()["waiters"] == 2, "B's turn to wait beside A's, superseding nothing")
    assert not first.done()
    tenant_a = tenant_tag(CLIENT_KEY)
    gate.app.admission.finish_session(scoped_session(tenant_a, "filler"))
    assert await asyncio.wait_for(first, 30) == 200
    gate.app.admission.finish_session(scoped_session(tenant_a, "agent"))
    assert await asyncio.wait_for(second, 30) == 200
