"""Every way a turn can end gives back its place in `replica.in_flight` and its lease
exactly once: no double release, no leak (proxy/turn_hold.py).

The gate is the real AdmissionController; each of its leases is wrapped so the test
counts how often the proxy releases it (the gate's own release is idempotent and would
hide a second one). Refusals and a gate that keeps the turn waiting are scripted in
front of the real gate.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from scripted_server import ScriptedServer

from kvgate.gate.admission import AdmissionController
from kvgate.gate.errors import AdmissionSuperseded, ReplicaUnavailable
from kvgate.gate.settings import GateSettings
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.turn_hold import Hold
from kvgate.proxy.turn_route import AfterFailure, Failure, Resend, after_failure

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**CHAT, "stream": True}
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class CountedLease:
    """A real gate lease that records every release the proxy makes (its `served` flag)."""

    def __init__(self, lease) -> None:
        self.lease = lease
        self.releases: list[bool] = []

    @property
    def reason(self) -> str:
        return self.lease.reason

    @property
    def wait_ms(self) -> float:
        return self.lease.wait_ms

    @property
    def priority(self) -> int | None:
        return self.lease.priority

    def release(self, served: bool = True) -> None:
        self.releases.append(served)
        self.lease.release(served)

    def learn(self, prompt_tokens: int, cached_tokens: int | None, output_tokens: int | None = None) -> None:
        self.lease.learn(prompt_tokens, cached_tokens, output_tokens)


class CountedAdmission:
    """The real AdmissionController with every lease counted. `refuse[name]`: errors raised
    (in turn) before the gate is asked; `hold`: an Event every acquire waits on first."""

    def __init__(self, settings: GateSettings) -> None:
        self.gate = AdmissionController(settings, KvgateMetrics().gate)
        self.leases: list[CountedLease] = []
        self.refuse: dict[str, list[BaseException]] = {}
        self.hold: asyncio.Event | None = None
        self.waiting = 0

    async def acquire(self, replica, session_id, route_kind, body, elsewhere=None, body_size=None):
        errors = self.refuse.get(replica.name)
        if errors:
            raise errors.pop(0)
        if self.hold is not None:
            self.waiting += 1
            await self.hold.wait()
        lease = CountedLease(await self.gate.acquire(replica, session_id, route_kind, body, body_size=body_size))
        self.leases.append(lease)
        return lease

    def __getattr__(self, name):  # finish_session, remove_replica, state, aclose ...: the real gate's
        return getattr(self.gate, name)


async def released(client, admission: CountedAdmission, served: list[bool]) -> None:
    """Wait for the handlers to finish, then: each lease released exactly once with the
    expected `served`, no replica with a request in flight, the gate without a lease or waiter."""
    for _ in range(250):
        if all(lease.releases for lease in admission.leases) and not any(
            r.in_flight for r in client.app.registry.all()
        ):
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)  # a second release would come from the same handler's exit
    assert [lease.releases for lease in admission.leases] == [[s] for s in served]
    assert {r.name: r.in_flight for r in client.app.registry.all()} == {r.name: 0 for r in client.app.registry.all()}
    counts = admission.gate.counts()
    assert (counts["leases"], counts["waiters"]) == (0, 0), counts


async def scripted(reply) -> ScriptedServer:
    server = await ScriptedServer(reply).start()
    server.name = "g0"
    return server


@pytest.fixture
async def gated(upstreams, make_proxy):
    admission = CountedAdmission(GateSettings())
    client = await make_proxy(upstreams, admission=admission)
    return client, admission


async def first_replica(client, session: str) -> str:
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": session})
    assert resp.status == 200
    return resp.headers["x-kvgate-replica"]


async def test_connect_error_resends_to_the_other_replica(gated, upstreams):
    client, admission = gated
    first = await first_replica(client, "c")
    await next(f for f in upstreams if f.name == first).refuse()
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "c"})
    assert (resp.status, resp.headers["x-kvgate-replica"] != first) == (200, True)
    await released(client, admission, [True, False, True])


async def test_connect_error_everywhere_is_a_502(gated, upstreams):
    client, admission = gated
    for fake in upstreams:
        await fake.refuse()
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "c2"})
    assert (resp.status, (await resp.json())["error"]["code"]) == (502, "upstream_connect_failed")
    await released(client, admission, [False, False])


async def test_tiers_resend_to_a_busy_replica_once(make_proxy):
    """A front door whose replica gate has a turn in flight and then refuses connections:
    the next turn is re-sent to it once (not marked failed), then answered 502."""
    go = asyncio.Event()
    server = await scripted(lambda i: [go, OK])
    admission = CountedAdmission(GateSettings(mode="off"))
    client = await make_proxy([server], admission=admission, role="front_door")
    try:
        busy = asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "a"}))
        while not server.requests:
            await asyncio.sleep(0.01)
        server.server.close()  # stop listening; the busy connection stays
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "b"})
        assert (resp.status, (await resp.json())["error"]["code"]) == (502, "upstream_connect_failed")
        assert client.app.registry.get("g0").healthy  # busy, not dead
        assert len(admission.leases) == 3  # the busy turn's, and the refused turn's two tries
        go.set()
        assert (await busy).status == 200
        await released(client, admission, [True, False, False])
    finally:
        go.set()
        await server.stop()


async def test_upstream_fails_before_answering(make_proxy):
    server = await scripted(lambda i: None)  # closes the connection without an answer
    admission = CountedAdmission(GateSettings(mode="off"))
    client = await make_proxy([server], admission=admission)
    try:
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "x"})
        assert (resp.status, (await resp.json())["error"]["code"]) == (502, "upstream_failed")
        await released(client, admission, [False])
    finally:
        await server.stop()


@pytest.mark.parametrize(
    "mode, body, status, served",
    [
        ("close_mid_stream", STREAM, 200, True),  # the SSE stream ends with an error event
        ("truncate_body", CHAT, 502, True),  # a buffered body broken off: a clean 502
        ("status500", CHAT, 500, False),  # an error answer served no prompt
    ],
)
async def test_upstream_errors_after_the_headers(gated, upstreams, mode, body, status, served):
    client, admission = gated
    for fake in upstreams:
        fake.mode = mode
    resp = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": "m"})
    assert resp.status == status
    text = await resp.text()
    if mode == "close_mid_stream":
        assert "upstream_stream_broken" in text
    await released(client, admission, [served])


async def test_client_disconnect_mid_stream(gated, upstreams):
    client, admission = gated
    for fake in upstreams:
        fake.chunk_delay, fake.chunks = 0.5, 50
    resp = await client.post("/v1/chat/completions", json=STREAM, headers={"x-session-id": "d"})
    assert await resp.content.readany()
    resp.close()  # the client goes away mid-stream
    await released(client, admission, [True])


async def test_client_disconnect_while_waiting_for_admission(gated, upstreams):
    client, admission = gated
    admission.hold = asyncio.Event()
    with pytest.raises(asyncio.TimeoutError):
        await client.post(
            "/v1/chat/completions", json=CHAT, headers={"x-session-id": "w"}, timeout=aiohttp.ClientTimeout(total=0.3)
        )
    assert admission.waiting == 1
    await released(client, admission, [])
    assert not any(f.requests for f in upstreams)


async def test_admission_refused_holds_nothing(gated, upstreams):
    client, admission = gated
    superseded = AdmissionSuperseded("a newer attempt of this session arrived")
    admission.refuse = {"r0": [superseded], "r1": [superseded]}
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "p"})
    assert resp.status == 409
    await released(client, admission, [])
    assert not any(f.requests for f in upstreams)


async def test_replica_unavailable_resends_to_the_other_replica(gated):
    client, admission = gated
    first = await first_replica(client, "u")
    admission.refuse = {first: [ReplicaUnavailable("removed while waiting")]}
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "u"})
    assert (resp.status, resp.headers["x-kvgate-replica"] != first) == (200, True)
    await released(client, admission, [True, True])


# ---- the pure parts --------------------------------------------------------------


@pytest.mark.parametrize(
    "failure, spent, tiered, in_flight, expected",
    [
        (Failure.CONNECT, set(), False, 0, AfterFailure(True, Resend.OTHER)),
        (Failure.CONNECT, set(), False, 3, AfterFailure(True, Resend.OTHER)),  # standalone: busy is no evidence
        (Failure.CONNECT, set(), True, 0, AfterFailure(True, Resend.OTHER)),
        (Failure.CONNECT, set(), True, 1, AfterFailure(False, Resend.SAME)),  # tiers: busy, not dead
        (Failure.CONNECT, {Failure.CONNECT}, True, 1, AfterFailure(False, Resend.NOWHERE)),
        (Failure.CONNECT, {Failure.CONNECT}, False, 0, AfterFailure(True, Resend.NOWHERE)),
        (Failure.CONNECT, {Failure.UNAVAILABLE}, False, 0, AfterFailure(True, Resend.OTHER)),
        (Failure.UNAVAILABLE, set(), True, 1, AfterFailure(False, Resend.OTHER)),
        (Failure.UNAVAILABLE, {Failure.CONNECT}, False, 0, AfterFailure(False, Resend.OTHER)),
        (Failure.UNAVAILABLE, {Failure.UNAVAILABLE}, False, 0, AfterFailure(False, Resend.NOWHERE)),
    ],
)
def test_after_failure(failure, spent, tiered, in_flight, expected):
    assert after_failure(failure, frozenset(spent), tiered, in_flight) == expected


class Place:
    def __init__(self) -> None:
        self.in_flight = 0


class Lease:
    reason, wait_ms, priority = "r", 0.0, None

    def __init__(self) -> None:
        self.releases: list[bool] = []

    def release(self, served: bool = True) -> None:
        self.releases.append(served)


@pytest.mark.parametrize("release_inside", [False, True])
@pytest.mark.parametrize("raises", [None, RuntimeError, asyncio.CancelledError])
def test_hold_gives_back_exactly_once(release_inside, raises):
    replica, lease = Place(), Lease()
    try:
        with Hold(replica, lease) as held:  # type: ignore[arg-type]
            assert replica.in_flight == 1
            held.served = True
            if release_inside:
                held.release()
                assert (replica.in_flight, lease.releases) == (0, [True])
            if raises is not None:
                raise raises()
    except (RuntimeError, asyncio.CancelledError):
        assert raises is not None
    assert (replica.in_flight, lease.releases) == (0, [True])
