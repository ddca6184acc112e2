"""A bounded, seeded fuzz of the front door: mutations of valid requests as raw bytes.

Asserts, for every mutation: kvgate never answers 500 of its own (an upstream's 500
passes through with x-kvgate-replica), never logs an unhandled error, never leaves a
connection hanging past its timeouts; `/health` answers while they are in flight; and at the
end no request is in flight and no upstream connection is held.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time

from kvgate.proxy.settings import LimitsSettings

SEED = 20261130
MUTATIONS = 2000
BATCH = 100  # mutations in flight at once; /health is asked after each BATCH answers
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false}'
STREAM = b'{"model":"m","prompt":"hi","stream":true}'

VALID = [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: k\r\nContent-Type: application/json\r\nx-session-id: s1\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT),
    b"POST /v1/completions HTTP/1.1\r\nHost: k\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
    % (len(STREAM), STREAM),
    b"POST /sess/agent-7/v1/chat/completions?x=1 HTTP/1.1\r\nHost: k\r\nExpect: 100-continue\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT),
    b"GET /v1/models HTTP/1.1\r\nHost: k\r\nConnection: keep-alive, x-a\r\nx-a: 1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: k\r\n\r\nGET /ready HTTP/1.0\r\n\r\n",
    b"GET /admin/state HTTP/1.1\r\nHost: k\r\nAuthorization: Bearer test-admin-token\r\n\r\n",
]
INTERESTING = [
    b"\r",
    b"\n",
    b"\r\n",
    b"\x00",
    b" ",
    b"\t",
    b":",
    b",",
    b"-",
    b"0",
    b"9",
    b"f",
    b"x",
    b"\x7f",
    b"\xff",
    b"\x80",
    b"%",
    b"%ff",
    b"/",
    b"?",
    b'"',
    b"{",
    b"}",
    b"\r\n ",
    b"-1",
    b"Transfer-Encoding: chunked\r\n",
    b"Content-Length: 5\r\n",
    b"Content-Length: 99999999999\r\n",
    b"\r\n\r\n",
    b"HTTP/1.1 ",
    b"GET / HTTP/1.1\r\n",
]


def mutate(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(5)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:  # replace one byte
            pos = min(pos, len(data) - 1)
            data[pos : pos + 1] = rng.choice(INTERESTING)
        elif op == 1:  # insert
            data[pos:pos] = rng.choice(INTERESTING)
        elif op == 2:  # delete a run
            del data[pos : pos + rng.randint(1, 8)]
        elif op == 3:  # duplicate a run (repeated header lines, doubled framing)
            end = min(len(data), pos + rng.randint(1, 40))
            data[pos:pos] = data[pos:end] * rng.randint(1, 3)
        else:  # truncate
            del data[pos:]
    return bytes(data)


async def send(address, raw: bytes) -> bytes:
    """Everything kvgate writes back until it closes; a hang fails the test."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(raw)
        return await asyncio.wait_for(reader.read(-1), 5)  # timeouts below are 0.3 s
    except ConnectionError:
        return b""
    finally:
        writer.close()


def kvgate_500s(data: bytes) -> int:
    """500 answers kvgate made itself (an upstream's 500 carries x-kvgate-replica)."""
    count = 0
    for match in re.finditer(rb"HTTP/1\.1 500 [^\r]*\r\n(.*?)\r\n\r\n", data, re.S):
        if b"x-kvgate-replica" not in match.group(1).lower():
            count += 1
    return count + data.count(b"internal_error")


async def test_seeded_fuzz_of_request_bytes(make_proxy, upstreams, caplog):
    caplog.set_level(logging.WARNING)
    limits = LimitsSettings(
        header_timeout_sec=0.3, body_timeout_sec=0.3, keepalive_timeout_sec=0.3, max_body_bytes=1 << 20
    )
    proxy = await make_proxy(upstreams, limits=limits)
    address = (proxy.server.host, proxy.server.port)
    rng = random.Random(SEED)
    cases = [mutate(rng, rng.choice(VALID)) for _ in range(MUTATIONS)]
    seen_statuses: set[bytes] = set()
    # A window of BATCH connections, not batches one after another: a batch would wait for
    # its slowest mutation (one that times out) while the others' slots stay idle.
    window = asyncio.Semaphore(BATCH)

    async def send_in_window(raw: bytes) -> bytes:
        async with window:
            return await send(address, raw)

    sends = [asyncio.ensure_future(send_in_window(raw)) for raw in cases]
    try:
        for start in range(0, len(cases), BATCH):
            answers = await asyncio.gather(*sends[start : start + BATCH])
            for raw, data in zip(cases[start : start + BATCH], answers):
                assert kvgate_500s(data) == 0, (raw, data[:500])
                seen_statuses.update(re.findall(rb"HTTP/1\.[01] (\d{3}) ", data))
            # asked while the next mutations are in flight
            health = await send(address, b"GET /health HTTP/1.1\r\nHost: k\r\nConnection: close\r\n\r\n")
            assert health.startswith(b"HTTP/1.1 200 "), health
    finally:
        for pending in sends:
            pending.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
    assert {b"200", b"400"} <= seen_statuses  # the mutations reached both sides of the parser
    replicas = proxy.app.registry.all()

    def settled() -> bool:  # the last requests' releases land after their answers, later on a loaded machine
        return all(r.in_flight == 0 and proxy.app.clients.for_replica(r).in_use == 0 for r in replicas)

    deadline = time.monotonic() + 30
    while not settled() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    for replica in replicas:
        assert replica.in_flight == 0
        assert proxy.app.clients.for_replica(replica).in_use == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and _about_kvgate(r)]
    assert not errors, [r.getMessage() for r in errors[:5]]


def _about_kvgate(record: logging.LogRecord) -> bool:
    """kvgate's own error logs, and asyncio's about a task running kvgate code; not the
    garbage collection of another test's client (an httpx client closed after its loop,
    logged by asyncio while this test runs on the same worker)."""
    if record.name.startswith("kvgate"):
        return True
    trace = logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
    return "kvgate" in record.getMessage() + trace
