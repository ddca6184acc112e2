"""Raw-bytes conformance table of the front door and the upstream client.

One row per finding of the HTTP review, named after it (`f1_...` is finding 1). Every row
sends the bytes a hostile client or a broken upstream sent, to a real kvgate on
loopback, and states what RFC 9112/9110 (and nginx) make of them. Each row failed on
the hand-written parser that came before llhttp, and passes now.

Request side: kvgate in front of a raw recording upstream (`ScriptedServer`), so a
row can also assert what reached the upstream. Response side: the scripted upstream
plays the broken server byte for byte.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from scripted_server import ScriptedServer

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import AdminSettings, LimitsSettings, Settings

TOKEN = "conformance-admin"
ADMIN = f"Authorization: Bearer {TOKEN}\r\n".encode()
UP_BODY = b'{"ok":true}'
UP_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n" + UP_BODY
CHAT = b'{"model":"m","messages":[]}'


def post(headers: bytes, body: bytes = CHAT, path: bytes = b"/v1/chat/completions") -> bytes:
    return b"POST " + path + b" HTTP/1.1\r\nHost: k\r\n" + headers + b"\r\n" + body


def post_cl(extra: bytes = b"", body: bytes = CHAT, path: bytes = b"/v1/chat/completions") -> bytes:
    return post(extra + b"Content-Length: %d\r\n" % len(body), body, path)


def chunked(size_line: bytes, data: bytes = CHAT) -> bytes:
    return post(b"Transfer-Encoding: chunked\r\n", size_line + b"\r\n" + data + b"\r\n0\r\n\r\n")


def statuses(data: bytes) -> list[int]:
    return [int(s) for s in re.findall(rb"(?:^|\r\n\r\n|})HTTP/1\.1 (\d{3}) ", data)]


async def exchange(address, raw: bytes, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send `raw` on a new connection; (everything read, whether kvgate closed the
    connection within `timeout`)."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(raw)
    data = b""
    closed = False
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                piece = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                break
            if not piece:
                closed = True
                break
            data += piece
    except ConnectionError:
        closed = True
    finally:
        writer.close()
    return data, closed


async def until(condition, what: str, timeout: float = 30.0) -> None:
    """Wait for `condition()` (a state the server reaches on its own time, later on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.01)


class Stack:
    """kvgate (gate off, admin on) in front of one scripted upstream named r0."""

    def __init__(self, upstream: ScriptedServer, app) -> None:
        self.upstream = upstream
        self.app = app
        self.address = None

    async def health_ok(self) -> bool:
        data, _ = await exchange(self.address, b"GET /health HTTP/1.1\r\nHost: k\r\nConnection: close\r\n\r\n")
        return statuses(data) == [200]


@pytest.fixture
async def stack_factory():
    made: list[Stack] = []

    async def make(reply=lambda i: UP_OK, **limits) -> Stack:
        upstream = await ScriptedServer(reply).start()
        settings = Settings(
            replicas=(ReplicaSettings("r0", upstream.url),),
            gate=GateSettings(mode="off"),
            admin=AdminSettings(token=TOKEN),
            limits=LimitsSettings(**limits),
        )
        stack = Stack(upstream, create_app(settings, health_checks=False))
        stack.address = await stack.app.start("127.0.0.1", 0)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        await stack.app.close()
        await stack.upstream.stop()


# ---- request side: refused with 4xx before anything reaches the upstream ----------------

SMUGGLED = b"GET /any-upstream-path HTTP/1.1\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
REFUSED_REQUESTS = [
    ("f1_bare_lf_in_value_smuggles", post(b"X-A: a\n\n" + SMUGGLED[:-4] + b"\r\n", b"{}"), 400),
    ("f1_bare_lf_in_value_cl", post_cl(b"X-A: a\nX-B: b\r\n"), 400),
    ("f1_bare_cr_in_value", post_cl(b"X-A: a\rGET /x HTTP/1.1\r\n"), 400),
    ("f1_nul_in_value", post_cl(b"X-A: a\x00b\r\n"), 400),
    ("f1_space_in_name", post_cl(b"X A: a\r\n"), 400),
    ("f1_paren_in_name", post_cl(b"X(A): a\r\n"), 400),
    ("f1_quote_in_name", post_cl(b'X"A: a\r\n'), 400),
    ("f1_at_in_name", post_cl(b"X@A: a\r\n"), 400),
    ("f1_obs_fold", post_cl(b"X-A: a\r\n Evil: 1\r\n"), 400),
    ("f1_control_byte_in_query", b"GET /v1/models?a=\x01b HTTP/1.1\r\nHost: k\r\n\r\n", 400),
    # the reproducer: a negative chunk consumes nothing and drives the body counter negative
    (
        "f4_negative_chunk_size",
        post(b"Transfer-Encoding: chunked\r\n", b"-FFFFFFFFFFFF\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT)),
        400,
    ),
    ("f9_te_xchunked", chunked(b"%x" % len(CHAT)).replace(b": chunked", b": xchunked"), 400),
    ("f9_te_chunked_gzip", chunked(b"%x" % len(CHAT)).replace(b": chunked", b": chunked, gzip"), 400),
    ("f9_te_gzip_chunked", chunked(b"%x" % len(CHAT)).replace(b": chunked", b": gzip, chunked"), 400),
    ("f9_te_unchunked", chunked(b"%x" % len(CHAT)).replace(b": chunked", b": unchunked"), 400),
    (
        "f9_cl_with_te",
        chunked(b"%x" % len(CHAT)).replace(b"Transfer", b"Content-Length: %d\r\nTransfer" % len(CHAT)),
        400,
    ),
    ("f9_cl_arabic_indic_digit", post("Content-Length: ٧\r\n".encode(), b"{}     "), 400),
    ("f9_cl_fullwidth_digit", post("Content-Length: ７\r\n".encode(), b"{}     "), 400),
    ("f9_chunk_size_0x", chunked(b"0x%x" % len(CHAT)), 400),
    ("f9_chunk_size_plus", chunked(b"+%x" % len(CHAT)), 400),
    ("f9_chunk_size_underscore", chunked(b"0_%x" % len(CHAT)), 400),
    ("f10_cl_superscript_two", post("Content-Length: ²\r\n".encode(), b"{}"), 400),
    ("f10_invalid_utf8_in_path", b"GET /v1/mod\xffels HTTP/1.1\r\nHost: k\r\n\r\n", 400),
    ("f10_invalid_utf8_in_sess_path", post_cl(path=b"/sess/\xff/v1/chat/completions"), 400),
    ("f10_invalid_utf8_in_sess_path_encoded", post_cl(path=b"/sess/%ff/v1/chat/completions"), 400),
    ("f10_invalid_utf8_in_session_header", post_cl(b"x-session-id: a\xffb\r\n"), 400),
]


# Refused by the HTTP layer, which then closes the connection; the rest are well-formed
# HTTP whose ids are not UTF-8 text, refused by the proxy on a connection that stays open.
KEPT_OPEN = {"f10_invalid_utf8_in_sess_path_encoded", "f10_invalid_utf8_in_session_header"}


@pytest.mark.parametrize(
    "raw, status, closes",
    [pytest.param(raw, status, name not in KEPT_OPEN, id=name) for name, raw, status in REFUSED_REQUESTS],
)
async def test_request_refused(stack_factory, raw, status, closes):
    stack = await stack_factory()
    # kept open: still open 0.3 s after the answer (a connection the server drops closes with its answer)
    data, closed = await exchange(stack.address, raw, timeout=5 if closes else 0.3)
    assert statuses(data) == [status], data[:300]
    assert b"Traceback" not in data
    assert closed is closes
    assert stack.upstream.requests == []  # nothing of it reached the upstream
    assert await stack.health_ok()


async def test_f1_smuggled_request_never_reaches_the_upstream_and_the_pool_stays_clean(stack_factory):
    """The exact reproducer: behind it, the next client gets its own answer."""
    stack = await stack_factory(reply=lambda i: UP_OK)
    raw = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nX-A: a\n\n" + SMUGGLED
    data, closed = await exchange(stack.address, raw)
    assert statuses(data) == [400] and closed
    assert not any(b"/any-upstream-path" in r for r in stack.upstream.requests)


async def test_f3_huge_pipelined_head_behind_a_first_request_is_431_without_blocking(stack_factory):
    """The first request waits 0.5 s on its upstream, so the whole second head is
    buffered behind it before it is read."""
    first = post_cl()
    second = b"GET /health HTTP/1.1\r\nHost: k\r\n" + b"a: b\r\n" * 200_000 + b"\r\n"
    stack = await stack_factory(reply=lambda i: [0.5, UP_OK])
    started = time.monotonic()
    data, closed = await exchange(stack.address, first + second, timeout=10)
    assert statuses(data) == [200, 431] and closed
    assert time.monotonic() - started < 5
    assert await stack.health_ok()


async def test_f3_head_limit_applies_to_every_request_of_a_connection(stack_factory):
    stack = await stack_factory(max_head_bytes=4096)
    ok = b"GET /health HTTP/1.1\r\nHost: k\r\n\r\n"
    big = b"GET /health HTTP/1.1\r\nHost: k\r\nX-Big: " + b"x" * 5000 + b"\r\n\r\n"
    data, closed = await exchange(stack.address, ok + ok + big)
    assert statuses(data) == [200, 200, 431] and closed


async def test_f3_header_count_limit(stack_factory):
    stack = await stack_factory(max_headers=20)
    raw = b"GET /health HTTP/1.1\r\nHost: k\r\n" + b"".join(b"h%d: v\r\n" % i for i in range(20)) + b"\r\n"
    data, closed = await exchange(stack.address, raw)
    assert statuses(data) == [431] and closed


async def test_f4_chunked_body_cannot_pass_the_body_limit(stack_factory):
    stack = await stack_factory(max_body_bytes=1000)
    big = CHAT[:-1] + b" " * 2048 + b"}"  # valid JSON, twice the limit
    raw = post(b"Transfer-Encoding: chunked\r\n", b"-FFFFFFFFFFFF\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
    data, closed = await exchange(stack.address, raw)
    assert statuses(data) == [400] and closed
    raw = post(b"Transfer-Encoding: chunked\r\n", b"400\r\n" + b"x" * 1024 + b"\r\n0\r\n\r\n")
    data, closed = await exchange(stack.address, raw)
    assert statuses(data) == [413] and closed
    assert stack.upstream.requests == []


async def test_f5_slow_head_gets_408_after_the_header_timeout(stack_factory):
    """A client sending its head one byte per 50 ms is answered 408 and closed."""
    stack = await stack_factory(header_timeout_sec=0.5)
    reader, writer = await asyncio.open_connection(*stack.address)
    started = time.monotonic()
    answer = asyncio.ensure_future(reader.read())  # until kvgate closes its side
    try:
        for byte in b"GET /health HTTP/1.1\r\nHost: k\r\nX-Slow: " + b"s" * 100:
            if answer.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)
        data = await asyncio.wait_for(answer, 3)
    finally:
        writer.close()
    assert statuses(data) == [408] and b"header_timeout_sec" in data
    assert time.monotonic() - started < 3
    assert await stack.health_ok()


async def test_f5_idle_keep_alive_connection_is_closed(stack_factory):
    stack = await stack_factory(keepalive_timeout_sec=0.3, header_timeout_sec=0.3)
    data, closed = await exchange(stack.address, b"GET /health HTTP/1.1\r\nHost: k\r\n\r\n", timeout=3)
    assert statuses(data) == [200] and closed
    data, closed = await exchange(stack.address, b"", timeout=3)  # connected, never sends a byte
    assert data == b"" and closed


async def test_f5_connections_beyond_the_limit_are_refused_cleanly(stack_factory):
    stack = await stack_factory(max_connections=4)
    held = [await asyncio.open_connection(*stack.address) for _ in range(4)]
    for _, writer in held:  # each is reading a body: none gives way to a new connection
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: k\r\nContent-Length: 100\r\n\r\n{")
    await until(lambda: [c.phase for c in stack.app._server.connections] == ["body"] * 4, "the server to read 4 bodies")
    data, closed = await exchange(stack.address, b"GET /health HTTP/1.1\r\nHost: k\r\n\r\n")
    assert statuses(data) == [503] and b"too_many_connections" in data and closed
    for _, writer in held:
        writer.close()
    await until(lambda: not stack.app._server.connections, "the server to see the 4 connections closed")
    assert await stack.health_ok()  # below the limit again: served


async def test_f11_headers_named_in_connection_are_not_forwarded(stack_factory):
    stack = await stack_factory(keepalive_timeout_sec=0.3)  # the kept-alive connection ends soon after the answer
    data, _ = await exchange(
        stack.address, post_cl(b"Connection: keep-alive, X-Secret\r\nX-Secret: 1\r\nX-Kept: 2\r\n"), timeout=2
    )
    assert statuses(data) == [200]
    (forwarded,) = stack.upstream.requests
    assert b"x-secret" not in forwarded.lower() and b"X-Kept: 2\r\n" in forwarded


@pytest.mark.parametrize(
    "name, url",
    [
        ("evil\r\nSet-Cookie: a=b", "http://127.0.0.1:1"),
        ("has space", "http://127.0.0.1:1"),
        ("ok-name", "http://127.0.0.1:1/a b"),
        ("ok-name", "http://127.0.0.1:1/\r\nX: y"),
        ("ok-name", "http://127.0.0.1:99999"),
    ],
)
async def test_f11_replica_names_and_urls_from_the_admin_api_are_checked(stack_factory, name, url):
    import orjson

    stack = await stack_factory()
    body = orjson.dumps({"name": name, "url": url})
    data, _ = await exchange(stack.address, post_cl(ADMIN + b"Connection: close\r\n", body, b"/admin/replicas"))
    assert statuses(data) == [400], data
    assert [r.name for r in stack.app.registry.all()] == ["r0"]


async def test_f11_session_id_is_spliced_into_the_client_bytes(stack_factory):
    stack = await stack_factory()
    body = b'{"model":"m","n":18446744073709551616,"x":1,"x":2,"messages":[]}'
    data, _ = await exchange(stack.address, post_cl(b"x-session-id: s-1\r\nConnection: close\r\n", body))
    assert statuses(data) == [200]
    (forwarded,) = stack.upstream.requests
    sent = forwarded.split(b"\r\n\r\n", 1)[1]
    assert sent == b'{"session_id":"s-1",' + body[1:]
    assert b"Content-Length: %d\r\n" % len(sent) in forwarded


# ---- response side: a broken upstream gets a 502 and loses its connection -----------

H = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
BROKEN_RESPONSES = [
    ("f2_negative_chunk_size", [H + b"Transfer-Encoding: chunked\r\n\r\n-6\r\nabcdef\r\n0\r\n\r\n"]),
    ("f7_two_content_lengths", [H + b"Content-Length: 11\r\nContent-Length: 5\r\n\r\n" + UP_BODY]),
    ("f7_negative_content_length", [H + b"Content-Length: -5\r\n\r\n" + UP_BODY]),
    ("f7_status_99999", [b"HTTP/1.1 99999 X\r\nContent-Length: 11\r\n\r\n" + UP_BODY]),
    ("f7_status_minus_1", [b"HTTP/1.1 -1 X\r\nContent-Length: 11\r\n\r\n" + UP_BODY]),
    ("f7_status_0", [b"HTTP/1.1 0 X\r\nContent-Length: 11\r\n\r\n" + UP_BODY]),
    ("f7_status_600", [b"HTTP/1.1 600 X\r\nContent-Length: 11\r\n\r\n" + UP_BODY]),
    ("f7_status_line_foo", [b"FOO 200 OK\r\nContent-Length: 11\r\n\r\n" + UP_BODY]),
    ("f7_bare_lf_in_header_value", [H + b"X-A: a\nX-Injected: 1\r\nContent-Length: 11\r\n\r\n" + UP_BODY]),
    ("f9_upstream_te_xchunked", [H + b"Transfer-Encoding: xchunked\r\n\r\nb\r\n" + UP_BODY + b"\r\n0\r\n\r\n"]),
    ("f9_upstream_chunk_size_0x", [H + b"Transfer-Encoding: chunked\r\n\r\n0xb\r\n" + UP_BODY + b"\r\n0\r\n\r\n"]),
]


@pytest.mark.parametrize("reply", [pytest.param(r, id=name) for name, r in BROKEN_RESPONSES])
async def test_broken_upstream_response_is_502(stack_factory, reply):
    stack = await stack_factory(reply=lambda i: reply)
    data, _ = await exchange(stack.address, post_cl(b"Connection: close\r\n"), timeout=5)
    assert statuses(data) == [502], data[:300]
    assert b"upstream_failed" in data and b"X-Injected" not in data
    assert stack.app.clients.for_replica(stack.app.registry.get("r0")).in_use == 0
    assert stack.app.clients.for_replica(stack.app.registry.get("r0"))._idle == []  # dropped, not pooled
    assert await stack.health_ok()


async def test_f6_stray_bytes_after_a_response_drop_the_pooled_connection(stack_factory):
    answered = []

    def reply(i):
        answered.append(i)
        n = len(answered)
        body = b'{"answer":%d}' % n
        answer = H + b"Content-Length: %d\r\n\r\n" % len(body) + body
        if n == 1:  # more than its Content-Length: a whole second response nobody asked for
            return answer + H + b'Content-Length: 14\r\n\r\n{"stray":true}'
        return answer

    stack = await stack_factory(reply=reply)
    bodies = []
    for _ in range(3):
        data, _ = await exchange(stack.address, post_cl(b"Connection: close\r\n"), timeout=5)
        assert statuses(data) == [200], data
        bodies.append(data.split(b"\r\n\r\n", 1)[1])
    assert bodies == [b'{"answer":1}', b'{"answer":2}', b'{"answer":3}']
    assert stack.upstream.connections == 2  # the poisoned connection was not reused


async def test_f6_bytes_arriving_on_an_idle_pooled_connection_drop_it(stack_factory):
    late = asyncio.Event()

    def reply(i):
        if i == 0:
            return [H + b"Content-Length: 11\r\n\r\n" + UP_BODY, late, H + b"Content-Length: 5\r\n\r\nstray"]
        return UP_OK

    stack = await stack_factory(reply=reply)
    data, _ = await exchange(stack.address, post_cl(b"Connection: close\r\n"), timeout=5)
    assert statuses(data) == [200]
    late.set()  # the upstream now writes on the idle pooled connection
    await asyncio.sleep(0.2)
    data, _ = await exchange(stack.address, post_cl(b"Connection: close\r\n"), timeout=5)
    assert statuses(data) == [200] and data.endswith(UP_BODY)


async def test_f8_large_non_streamed_answer_is_relayed_as_it_arrives(stack_factory):
    """The head and the first megabytes reach the client while the upstream still holds
    back the rest: kvgate does not buffer the whole body."""
    size = 8 * 1024 * 1024
    first = b"x" * (size // 2)
    rest_may_go = asyncio.Event()
    stack = await stack_factory(
        reply=lambda i: [H + b"Content-Length: %d\r\n\r\n" % size, first, rest_may_go, b"y" * (size - len(first))],
        max_buffered_response_bytes=1024 * 1024,
    )
    reader, writer = await asyncio.open_connection(*stack.address)
    writer.write(post_cl(b"Connection: close\r\n"))
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: %d\r\n" % size in head
        got = len(await asyncio.wait_for(reader.readexactly(1024 * 1024), 5))
        rest_may_go.set()
        got += len(await asyncio.wait_for(reader.read(), 10))
        while piece := await asyncio.wait_for(reader.read(1 << 20), 10):
            got += len(piece)
    finally:
        rest_may_go.set()
        writer.close()
    assert got == size


# ---- what held up, and must keep holding -------------------------------------------


async def test_upstream_framing_is_recomputed(stack_factory):
    stack = await stack_factory()
    data, _ = await exchange(
        stack.address,
        chunked(b"%x" % len(CHAT)).replace(b"Host: k\r\n", b"Host: k\r\nConnection: close\r\n"),
        timeout=3,
    )
    assert statuses(data) == [200]
    (forwarded,) = stack.upstream.requests
    assert b"Content-Length: %d\r\n" % len(CHAT) in forwarded and b"chunked" not in forwarded.lower()


def test_limits_defaults_follow_nginx():
    limits = LimitsSettings()
    assert (
        limits.header_timeout_sec,
        limits.body_timeout_sec,
        limits.keepalive_timeout_sec,
        limits.write_timeout_sec,
    ) == (60, 60, 75, 60)
    assert limits.max_head_bytes == 4 * 8 * 1024


async def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(stack_factory):
    """Backpressure holds the upstream while the client reads nothing; after
    limits.write_timeout_sec the client is dropped and its upstream connection closed."""
    size = 64 * 1024 * 1024
    stack = await stack_factory(
        reply=lambda i: [H + b"Content-Length: %d\r\n\r\n" % size] + [b"z" * (1 << 20)] * 64,
        write_timeout_sec=0.5,
        max_buffered_response_bytes=1 << 20,
    )
    reader, writer = await asyncio.open_connection(*stack.address, limit=1 << 16)
    writer.transport.pause_reading()  # read nothing at all
    writer.write(post_cl())
    replica = stack.app.registry.get("r0")
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and not (replica.in_flight == 0 and stack.upstream.requests):
        await asyncio.sleep(0.1)
    assert stack.upstream.requests and replica.in_flight == 0
    assert stack.app.clients.for_replica(replica).in_use == 0
    writer.transport.resume_reading()  # what reached the client socket before the drop, then the end
    received = 0
    try:
        while piece := await asyncio.wait_for(reader.read(1 << 20), 5):
            received += len(piece)
    except ConnectionError:
        pass
    writer.close()
    assert received < size  # dropped mid-answer, not served whole
    assert await stack.health_ok()


async def test_deep_pipelining_is_answered_in_order_with_bounded_queue(stack_factory):
    """2000 pipelined requests in one write: reading pauses while 64 wait, every one is
    answered, in order."""
    stack = await stack_factory()
    raw = b"".join(b"GET /nope-%d HTTP/1.1\r\nHost: k\r\n\r\n" % i for i in range(2000))
    raw += b"GET /health HTTP/1.1\r\nHost: k\r\nConnection: close\r\n\r\n"
    data, closed = await exchange(stack.address, raw, timeout=20)
    assert closed and statuses(data) == [404] * 2000 + [200]
    paths = re.findall(rb"unknown route GET /nope-(\d+)", data)
    assert [int(p) for p in paths] == list(range(2000))
