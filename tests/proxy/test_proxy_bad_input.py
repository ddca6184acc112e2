"""Bad input of every kind: an OpenAI-shaped error, and the proxy keeps serving."""

from __future__ import annotations

import asyncio
import re

import pytest

from kvgate.proxy.settings import LimitsSettings, UpstreamSettings

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def assert_error(resp, status: int, code: str | None = None) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def still_serving(client) -> None:
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "after"})
    assert resp.status == 200


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2, 3]", "invalid_body"),
        (b'"a string"', "invalid_body"),
        (b"", "invalid_body"),
        (b"   ", "invalid_body"),
    ],
)
async def test_body_not_a_json_object_is_400(proxy, raw, code):
    resp = await proxy.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    await assert_error(resp, 400, code)
    await still_serving(proxy)


@pytest.mark.parametrize(
    "body, field",
    [
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "stream": 1}, "stream"),
        ({**CHAT, "session_id": 42}, "session_id"),
        ({**CHAT, "metadata": {"session_id": ["x"]}}, "metadata.session_id"),
        ({**CHAT, "user": {"id": 1}}, "user"),
    ],
)
async def test_wrong_type_in_a_field_the_proxy_reads_is_400(proxy, upstreams, body, field):
    resp = await proxy.post("/v1/completions", json=body)
    error = await assert_error(resp, 400, "invalid_type")
    assert field in error["message"]
    assert not any(f.requests for f in upstreams)  # never forwarded
    await still_serving(proxy)


async def test_body_over_the_limit_is_413(make_proxy, upstreams):
    client = await make_proxy(upstreams, limits=LimitsSettings(max_body_bytes=1000))
    resp = await client.post("/v1/chat/completions", data=b"x" * 5000, headers={"Content-Type": "application/json"})
    error = await assert_error(resp, 413, "body_too_large")
    assert "limits.max_body_bytes" in error["message"]
    await still_serving(client)


async def test_chunked_body_over_the_limit_is_413(make_proxy, upstreams):
    client = await make_proxy(upstreams, limits=LimitsSettings(max_body_bytes=1000))

    async def chunks():
        for _ in range(10):
            yield b"x" * 500

    resp = await client.post("/v1/chat/completions", data=chunks())
    await assert_error(resp, 413, "body_too_large")
    await still_serving(client)


async def test_413_comes_without_reading_the_whole_body(make_proxy, upstreams):
    """The declared length alone decides: the client never sends the 10 MB it announced."""
    client = await make_proxy(upstreams, limits=LimitsSettings(max_body_bytes=1000))
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 10000000\r\n\r\n{"model":'
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    assert head.startswith(b"HTTP/1.1 413")
    writer.close()
    await still_serving(client)


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/nothing"),
        ("POST", "/v0/embeddings"),
        ("GET", "/sess/abc/unknown"),
        ("GET", "/v1/kvgate/kv"),  # kvgate's protocol with its replicas is not relayed for clients
    ],
)
async def test_unknown_route_is_404(proxy, method, path):
    """Outside vLLM's API (every other /v1/ and /v2/ route is the replica's to answer)."""
    resp = await proxy.request(method, path)
    await assert_error(resp, 404, "unknown_route")
    await still_serving(proxy)


async def test_wrong_method_on_a_known_route_is_405(proxy):
    await assert_error(await proxy.get("/v1/chat/completions"), 405, "method_not_allowed")


@pytest.mark.parametrize("path", ["/sess//v1/chat/completions", "/sess//v1/models"])
async def test_empty_sess_id_is_400(proxy, path):
    resp = await proxy.request("POST" if "chat" in path else "GET", path, json=CHAT if "chat" in path else None)
    error = await assert_error(resp, 400, "invalid_session_id")
    assert "/sess/" in error["message"]
    await still_serving(proxy)


async def test_no_healthy_replica_is_503_and_ready_503(proxy, upstreams):
    for replica in proxy.app.registry.all():
        proxy.app.registry.mark_failed(replica)
    resp = await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s"})
    await assert_error(resp, 503, "no_healthy_replica")
    assert resp.headers["Retry-After"]
    await assert_error(await proxy.get("/ready"), 503)
    assert (await proxy.get("/health")).status == 200
    for replica in proxy.app.registry.all():
        proxy.app.registry.record_check(replica, True)
    assert (await proxy.get("/ready")).status == 200
    await still_serving(proxy)


async def test_refusing_upstream_fails_over_then_502_when_none_left(proxy, upstreams):
    r0, r1 = upstreams
    await r0.refuse()
    # every session lands on r1 now: sessions of r0 fail over transparently
    for i in range(6):
        resp = await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": f"f{i}"})
        assert resp.status == 200
        assert resp.headers["x-kvgate-replica"] == "r1"
    await r1.refuse()
    resp = await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "f0"})
    await assert_error(resp, 502, "upstream_connect_failed")
    assert resp.headers["x-kvgate-replica"] == "r1"
    text = await (await proxy.get("/metrics")).text()
    assert 'kind="connect"' in text
    # both marked unhealthy now: a further request gets 503, and /ready says so
    await assert_error(await proxy.post("/v1/chat/completions", json=CHAT), 503, "no_healthy_replica")


async def test_single_refusing_upstream_is_502(make_proxy, upstreams):
    r0, _ = upstreams
    client = await make_proxy([r0])
    await r0.refuse()
    resp = await client.post("/v1/chat/completions", json=CHAT)
    await assert_error(resp, 502, "upstream_connect_failed")


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_500_passes_through_unchanged(proxy, upstreams, stream):
    for fake in upstreams:
        fake.mode = "status500"
    resp = await proxy.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers={"x-session-id": "e"})
    assert resp.status == 500
    body = await resp.json()
    assert body["error"]["message"].endswith("exploded")
    assert resp.headers["x-kvgate-replica"] == resp.headers["x-fake-replica"]
    for fake in upstreams:
        fake.mode = "ok"
    await still_serving(proxy)


async def test_upstream_closing_mid_stream_ends_with_an_sse_error_event(proxy, upstreams):
    for fake in upstreams:
        fake.mode = "close_mid_stream"
    resp = await proxy.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-session-id": "m"})
    assert resp.status == 200
    text = (await resp.read()).decode()
    events = [e for e in text.split("\n\n") if e.strip()]
    assert len(events) == 3  # two content chunks, then the error event
    assert events[-1].startswith('data: {"error":')
    assert "upstream_stream_broken" in events[-1]
    assert "[DONE]" not in text
    metrics = await (await proxy.get("/metrics")).text()
    assert 'kind="mid_stream"' in metrics
    for fake in upstreams:
        fake.mode = "ok"
    await still_serving(proxy)


async def test_anthropic_stream_broken_gets_an_anthropic_error_event(proxy, upstreams):
    for fake in upstreams:
        fake.mode = "close_mid_stream"
    resp = await proxy.post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    )
    text = (await resp.read()).decode()
    last = [e for e in text.split("\n\n") if e.strip()][-1]
    assert last.startswith("event: error\ndata: ")
    assert '"type":"error"' in last


async def test_upstream_closing_mid_body_non_streaming_is_502(proxy, upstreams):
    for fake in upstreams:
        fake.mode = "truncate_body"
    resp = await proxy.post("/v1/completions", json={"model": "m", "prompt": "x"})
    await assert_error(resp, 502, "upstream_failed")
    assert 'kind="mid_body"' in await (await proxy.get("/metrics")).text()
    for fake in upstreams:
        fake.mode = "ok"
    await still_serving(proxy)


async def test_slow_upstream_past_read_timeout_is_502(make_proxy, upstreams):
    client = await make_proxy(upstreams, upstream=UpstreamSettings(read_timeout_sec=0.2))
    for fake in upstreams:
        fake.mode = "slow"
        fake.slow_sec = 2
    resp = await client.post("/v1/chat/completions", json=CHAT)
    await assert_error(resp, 502, "upstream_failed")
    for fake in upstreams:
        fake.mode = "ok"
    await still_serving(client)


async def test_413_reaches_a_client_still_uploading(make_proxy, upstreams):
    """The client keeps sending after the 413: it still reads the error, not a reset."""
    client = await make_proxy(upstreams, limits=LimitsSettings(max_body_bytes=1000))
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n")
    for _ in range(20):
        writer.write(b"x" * 100_000)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    assert head.startswith(b"HTTP/1.1 413")
    body = await asyncio.wait_for(reader.read(), timeout=10)
    assert b"body_too_large" in body
    writer.close()


async def test_malformed_request_line_and_headers_are_400(proxy):
    for raw in (
        b"NONSENSE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nno-colon-here\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
    ):
        reader, writer = await asyncio.open_connection(proxy.server.host, proxy.server.port)
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 400"), head
        writer.close()
    await still_serving(proxy)


async def test_pipelined_requests_are_answered_in_order(proxy):
    reader, writer = await asyncio.open_connection(proxy.server.host, proxy.server.port)
    writer.write(
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    data = await asyncio.wait_for(reader.read(), timeout=10)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", data)
    assert statuses == [b"200", b"404", b"200"]
    writer.close()


async def test_expect_100_continue_and_chunked_request_body(proxy):
    reader, writer = await asyncio.open_connection(proxy.server.host, proxy.server.port)
    body = b'{"model": "m", "prompt": "hi"}'
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Transfer-Encoding: chunked\r\nx-session-id: e\r\n\r\n"
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    assert interim.startswith(b"HTTP/1.1 100")
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    assert head.startswith(b"HTTP/1.1 200")
    writer.close()
