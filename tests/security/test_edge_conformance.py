"""Security conformance, the third red-team pass (a keyed deployment's HTTP edge): one row
per finding, each playing the attack as it was reproduced against real parts on loopback
(kvgate apps, `kvgate replica`'s app, aiohttp clients and raw sockets). `e1_...` is
finding 1 of that pass. Every row failed on the code before these fixes and passes now.
"""

from __future__ import annotations

import asyncio

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
