"""The relay's HTTP/1.1 client against scripted raw servers (framing, reuse, errors)."""

from __future__ import annotations

import pytest
from scripted_server import ScriptedServer

from kvgate.proxy.http_client import UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamTimeout

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def serve(reply):
    return await ScriptedServer(reply).start()


async def test_content_length_body_and_keep_alive_reuse():
    server = await serve(lambda i: OK)
    pool = UpstreamPool(server.url, 5, 5)
    for _ in range(3):
        response = await pool.request("POST", "/v1/x", [(b"X-A", b"1")], b"{}")
        assert (response.status, await response.read()) == (200, b"ok")
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"X-A: 1\r\n" in server.requests[0] and server.requests[0].endswith(b"Content-Length: 2\r\n\r\n{}")
    pool.close()
    await server.stop()


async def test_chunked_body_with_extensions_and_trailers_arrives_piece_by_piece():
    reply = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n",
        b"5;ext=1\r\nhello\r\n",
        0.05,
        b"6\r\n world\r\n",
        0.05,
        b"0\r\nX-Trailer: t\r\n\r\n",
    ]
    server = await serve(lambda i: reply)
    pool = UpstreamPool(server.url, 5, 5)
    response = await pool.request("GET", "/", [], None)
    assert response.content_type == b"text/event-stream"
    pieces = []
    while chunk := await response.readany():
        pieces.append(chunk)
    assert pieces == [b"hello", b" world"]
    again = await pool.request("GET", "/", [], None)  # the connection was clean to reuse
    assert await again.read() == b"hello world"
    assert server.connections == 1
    pool.close()
    await server.stop()


async def test_interim_1xx_close_delimited_and_204():
    replies = {
        0: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx",
        1: b"HTTP/1.1 204 No Content\r\n\r\n",
        2: [b"HTTP/1.1 200 OK\r\n\r\nuntil ", b"close", None],
    }
    server = await serve(lambda i: replies[i])
    pool = UpstreamPool(server.url, 5, 5)
    assert await (await pool.request("GET", "/", [], None)).read() == b"x"
    no_content = await pool.request("GET", "/", [], None)
    assert (no_content.status, await no_content.read()) == (204, b"")
    response = await pool.request("GET", "/", [], None)  # no length, not chunked: until close
    assert await response.read() == b"until close"
    assert pool.in_use == 0 and server.connections == 1
    pool.close()
    await server.stop()


async def test_stale_keep_alive_connection_is_retried_once_on_a_fresh_one():
    server = await serve(lambda i: OK if i == 0 else None)  # a second request on a connection: hang up
    pool = UpstreamPool(server.url, 5, 5)
    assert await (await pool.request("POST", "/", [], b"1")).read() == b"ok"
    assert await (await pool.request("POST", "/", [], b"2")).read() == b"ok"
    assert server.connections == 2
    pool.close()
    await server.stop()


async def test_fresh_connection_closed_before_headers_is_an_error_not_a_retry():
    server = await serve(lambda i: None)
    pool = UpstreamPool(server.url, 5, 5)
    with pytest.raises(UpstreamError) as info:
        await pool.request("POST", "/", [], b"1")
    assert info.value.kind == "before_headers"
    assert server.connections == 1
    pool.close()
    await server.stop()


async def test_truncated_body_and_read_timeout_and_refused_connection():
    server = await serve(lambda i: [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", None])
    pool = UpstreamPool(server.url, 5, 5)
    response = await pool.request("GET", "/", [], None)
    with pytest.raises(UpstreamError) as info:
        await response.read()
    assert info.value.kind == "mid_body"

    server.reply = lambda i: [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", 5.0]
    slow = UpstreamPool(server.url, 5, 0.2)
    response = await slow.request("GET", "/", [], None)
    with pytest.raises(UpstreamTimeout):
        await response.read()
    pool.close()
    slow.close()
    await server.stop()
    with pytest.raises(UpstreamConnectError):
        await UpstreamPool(server.url, 5, 5).request("GET", "/", [], None)


async def test_closing_a_response_drops_its_connection():
    server = await serve(lambda i: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", 5.0])
    pool = UpstreamPool(server.url, 5, 5)
    response = await pool.request("GET", "/", [], None)
    assert await response.readany() == b"abc"
    response.close()
    assert pool.in_use == 0
    server.reply = lambda i: OK
    assert await (await pool.request("GET", "/", [], None)).read() == b"ok"
    assert server.connections == 2  # the aborted connection was never reused
    pool.close()
    await server.stop()
