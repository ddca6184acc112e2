"""Forwarding and relaying through the proxy against fake replicas."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from kvgate.proxy.settings import SessionSettings, UpstreamSettings

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ROUTE_BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "m", "prompt": "hi"},
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "input": "hi"},
}


def replica_of(resp) -> str:
    return resp.headers["x-kvgate-replica"]


@pytest.mark.parametrize("path", sorted(ROUTE_BODIES))
async def test_non_streaming_body_status_and_headers_pass_through(proxy, upstreams, path):
    resp = await proxy.post(path, json=ROUTE_BODIES[path], headers={"x-session-id": "s1"})
    assert resp.status == 200
    body = await resp.read()
    replica = replica_of(resp)
    assert resp.headers["x-fake-replica"] == replica
    assert resp.headers["x-kvgate-admission"] == "open"
    assert resp.headers["x-kvgate-wait-ms"] == "0"
    assert resp.headers["Content-Type"].startswith("application/json")
    assert f"hello from {replica}".encode() in body
    fake = next(f for f in upstreams if f.name == replica)
    assert fake.requests[-1]["path"] == path


@pytest.mark.parametrize("path", sorted(ROUTE_BODIES))
async def test_streaming_relays_every_event(proxy, upstreams, path):
    resp = await proxy.post(path, json={**ROUTE_BODIES[path], "stream": True}, headers={"x-session-id": "s2"})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    text = (await resp.read()).decode()
    replica = replica_of(resp)
    assert replica in text and " t4" in text  # first and last content chunk (5 chunks)
    if path != "/v1/messages":
        assert text.rstrip().endswith("data: [DONE]")
    else:
        assert "message_stop" in text


async def test_models_under_sess_prefix_is_sticky(proxy):
    seen = {replica_of(await proxy.get("/sess/abc/v1/models")) for _ in range(5)}
    assert len(seen) == 1
    resp = await proxy.get("/v1/models", headers={"x-session-id": "abc"})
    assert replica_of(resp) in seen  # path id and header id are the same session


async def test_same_session_same_replica_and_sessions_spread(proxy):
    placements = {}
    for i in range(40):
        sid = f"session-{i}"
        first = replica_of(await proxy.post("/v1/chat/completions", json={**CHAT, "session_id": sid}))
        again = replica_of(await proxy.post(f"/sess/{sid}/v1/chat/completions", json=CHAT))
        assert first == again
        placements[sid] = first
    assert set(placements.values()) == {"r0", "r1"}


async def test_session_id_from_dotted_body_field(proxy):
    a = replica_of(await proxy.post("/v1/chat/completions", json={**CHAT, "metadata": {"session_id": "deep"}}))
    b = replica_of(await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "deep"}))
    assert a == b


async def test_session_id_forwarded_to_vllm_body_for_chat_only(proxy, upstreams):
    await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "fwd"})
    await proxy.post("/v1/messages", json=ROUTE_BODIES["/v1/messages"], headers={"x-session-id": "fwd"})
    got = [r for f in upstreams for r in f.requests]
    chat = next(r for r in got if r["path"] == "/v1/chat/completions")
    messages = next(r for r in got if r["path"] == "/v1/messages")
    assert chat["body"]["session_id"] == "fwd"
    assert "session_id" not in messages["body"]


async def test_session_id_not_forwarded_when_disabled(make_proxy, upstreams):
    client = await make_proxy(upstreams, session=SessionSettings(forward_session_id=False))
    await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "nofwd"})
    body = next(r for f in upstreams for r in f.requests)["body"]
    assert "session_id" not in body


async def test_anonymous_requests_spread_over_replicas(proxy):
    seen = {replica_of(await proxy.post("/v1/chat/completions", json=CHAT)) for _ in range(6)}
    assert seen == {"r0", "r1"}


async def test_authorization_passes_through_and_hop_headers_do_not(proxy, upstreams):
    await proxy.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": "Bearer client-key", "x-session-id": "auth", "TE": "trailers", "X-Custom": "kept"},
    )
    headers = {k.lower(): v for k, v in next(r for f in upstreams for r in f.requests)["headers"].items()}
    assert headers["authorization"] == "Bearer client-key"
    assert headers["x-custom"] == "kept"
    assert "te" not in headers


async def test_upstream_api_key_replaces_client_authorization(make_proxy, upstreams):
    client = await make_proxy(upstreams, upstream=UpstreamSettings(api_key="server-key"))
    await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer client-key"})
    headers = {k.lower(): v for k, v in next(r for f in upstreams for r in f.requests)["headers"].items()}
    assert headers["authorization"] == "Bearer server-key"


async def test_request_body_reaches_upstream_unchanged_without_session(proxy, upstreams):
    body = {"model": "m", "messages": [{"role": "user", "content": "é ☃"}], "temperature": 0.5, "extra": [1, 2]}
    await proxy.post("/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    assert next(r for f in upstreams for r in f.requests)["body"] == body


async def test_query_string_is_forwarded(proxy, upstreams):
    resp = await proxy.get("/v1/models?limit=3", headers={"x-session-id": "q"})
    assert resp.status == 200
    assert any(r["path"] == "/v1/models" for f in upstreams for r in f.requests)


async def test_health_ready_and_metrics(proxy):
    assert (await proxy.get("/health")).status == 200
    assert (await proxy.get("/ready")).status == 200
    await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "m1"})
    await proxy.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "m1"})
    text = await (await proxy.get("/metrics")).text()
    assert 'kvgate_requests_total{replica="' in text and 'route="chat"' in text
    assert 'kvgate_turn_seconds_count{turn="1"} 1.0' in text
    assert 'kvgate_turn_seconds_count{turn="2-3"} 1.0' in text
    assert 'kvgate_replica_healthy{replica="r0"} 1.0' in text
    assert 'kvgate_admissions_total{reason="open"' in text


async def test_http10_client_gets_a_close_delimited_stream(proxy):
    reader, writer = await asyncio.open_connection(proxy.server.host, proxy.server.port)
    body = orjson.dumps({**CHAT, "stream": True})
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nx-session-id: old\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    data = await asyncio.wait_for(reader.read(), timeout=10)  # the proxy closes at the end
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"chunked" not in head.lower()
    assert payload.rstrip().endswith(b"data: [DONE]")
    writer.close()


async def test_keep_alive_connection_serves_many_requests(proxy):
    reader, writer = await asyncio.open_connection(proxy.server.host, proxy.server.port)
    body = orjson.dumps(CHAT)
    for _ in range(3):
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-session-id: ka\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")).split(b":")[1]
        )
        assert b"hello from" in await reader.readexactly(length)
    writer.close()
