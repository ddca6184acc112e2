"""The proxy's side of Seam 1: how it calls an AdmissionController and handles its errors."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from proxy_client import ADMIN_TOKEN

from kvgate.gate.errors import AdmissionSuperseded, AdmissionTimeout, PromptTooLong, ReplicaUnavailable

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class RecordedLease:
    def __init__(self, replica, reason="holds_window", wait_ms=12.5, priority=None):
        self.replica = replica
        self.reason = reason
        self.wait_ms = wait_ms
        self.priority = priority
        self.releases = 0
        self.served: list[bool] = []
        self.learned: list[tuple] = []

    def release(self, served=True):
        self.releases += 1
        self.served.append(served)

    def learn(self, prompt_tokens, cached_tokens, output_tokens=None):
        self.learned.append((prompt_tokens, cached_tokens))


class RecordingAdmission:
    """Admits everything, records every call; `refuse` maps replica name -> exception to raise."""

    def __init__(self):
        self.acquired: list[tuple] = []
        self.body_sizes: list[int | None] = []
        self.leases: list[RecordedLease] = []
        self.finished: list[str] = []
        self.removed: list[str] = []
        self.refuse: dict[str, list[BaseException]] = {}
        self.hold = None  # an asyncio.Event acquire waits on, when set
        self.cancelled = 0

    async def acquire(self, replica, session_id, route_kind, body, elsewhere=None, body_size=None):
        self.acquired.append((replica.name, session_id, route_kind, dict(body)))
        self.body_sizes.append(body_size)
        errors = self.refuse.get(replica.name)
        if errors:
            raise errors.pop(0)
        if self.hold is not None:
            try:
                await self.hold.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        lease = RecordedLease(replica)
        self.leases.append(lease)
        return lease

    def finish_session(self, session_id):
        self.finished.append(session_id)

    def placement(self):
        return None

    def remove_replica(self, name):
        self.removed.append(name)

    def state(self):
        return {"r0": {"waiters": [], "marker": "from-admission"}}


@pytest.fixture
def admission():
    return RecordingAdmission()


@pytest.fixture
async def gated(upstreams, make_proxy, admission):
    return await make_proxy(upstreams, admission=admission)


async def test_acquire_gets_replica_session_kind_and_body_and_headers_report_the_lease(gated, admission):
    resp = await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s1"})
    assert resp.status == 200
    name, session_id, kind, body = admission.acquired[0]
    assert (session_id, kind) == ("s1", "chat")
    assert body["messages"] == CHAT["messages"]
    assert resp.headers["x-kvgate-replica"] == name
    assert resp.headers["x-kvgate-admission"] == "holds_window"
    assert resp.headers["x-kvgate-wait-ms"] == "12.5"
    assert [lease.releases for lease in admission.leases] == [1]


async def test_acquire_gets_the_size_of_the_body_as_forwarded(gated, admission, upstreams):
    """The gate bounds a turn's prompt by the bytes the replica gets (spaces and all), not
    by an encoding of its own."""
    sent = json.dumps(CHAT, indent=2).encode()  # not compact: its length is its own
    resp = await gated.post(
        "/v1/chat/completions", data=sent, headers={"x-session-id": "s1", "Content-Type": "application/json"}
    )
    assert resp.status == 200
    forwarded = next(r for fake in upstreams for r in fake.requests if r["path"] == "/v1/chat/completions")
    assert admission.body_sizes == [int(forwarded["headers"]["Content-Length"])]
    assert admission.body_sizes[0] >= len(sent)  # kvgate's members spliced in, the client's bytes kept


async def test_anonymous_requests_acquire_with_none(gated, admission):
    await gated.get("/v1/models")
    assert admission.acquired[0][1:3] == (None, "models")


@pytest.mark.parametrize(
    "error, status, code",
    [
        (AdmissionSuperseded("a newer attempt of this session arrived"), 409, "admission_superseded"),
        (AdmissionTimeout("waited gate.max_wait_sec", retry_after=7), 503, "admission_timeout"),
        (PromptTooLong("prompt of 9000 blocks can never fit"), 400, "prompt_too_long"),
    ],
)
async def test_admission_errors_become_openai_errors(gated, admission, upstreams, error, status, code):
    admission.refuse = {"r0": [error], "r1": [error]}
    resp = await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "s"})
    assert resp.status == status
    body = await resp.json()
    assert body["error"]["code"] == code
    assert body["error"]["message"] == error.message
    assert body["error"]["type"] == error.error_type
    assert resp.headers["x-kvgate-replica"] in ("r0", "r1")
    if error.retry_after:
        assert resp.headers["Retry-After"] == "7"
    assert not any(f.requests for f in upstreams)


async def test_replica_unavailable_reroutes_once(gated, admission):
    first = (await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "u"})).headers[
        "x-kvgate-replica"
    ]
    other = "r1" if first == "r0" else "r0"
    admission.refuse = {first: [ReplicaUnavailable("removed while waiting")]}
    resp = await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "u"})
    assert resp.status == 200
    assert resp.headers["x-kvgate-replica"] == other
    assert [a[0] for a in admission.acquired[1:]] == [first, other]


async def test_replica_unavailable_twice_is_503(gated, admission):
    admission.refuse = {"r0": [ReplicaUnavailable("gone")], "r1": [ReplicaUnavailable("gone too")]}
    resp = await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "u2"})
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "replica_unavailable"
    assert len(admission.acquired) == 2


async def test_client_disconnect_while_waiting_cancels_the_acquire(gated, admission, upstreams):
    admission.hold = asyncio.Event()
    with pytest.raises(asyncio.TimeoutError):
        await gated.post(
            "/v1/chat/completions", json=CHAT, headers={"x-session-id": "w"}, timeout=aiohttp.ClientTimeout(total=0.3)
        )
    for _ in range(100):
        if admission.cancelled:
            break
        await asyncio.sleep(0.02)
    assert admission.cancelled == 1
    assert admission.leases == []
    text = await (await gated.get("/metrics")).text()
    assert 'kind="client_disconnect"' in text and 'status="499"' in text
    assert not any(f.requests for f in upstreams)
    assert all(r.in_flight == 0 for r in gated.app.registry.all())


async def test_lease_released_when_the_stream_ends_not_at_headers(gated, admission, upstreams):
    for fake in upstreams:
        fake.chunk_delay = 0.05
    resp = await gated.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-session-id": "st"})
    assert resp.status == 200
    first = await resp.content.readany()
    assert first
    assert admission.leases[0].releases == 0
    assert gated.app.registry.get(resp.headers["x-kvgate-replica"]).in_flight == 1
    await resp.read()
    await asyncio.sleep(0.01)
    assert admission.leases[0].releases == 1
    assert gated.app.registry.get(resp.headers["x-kvgate-replica"]).in_flight == 0


async def test_client_disconnect_mid_stream_aborts_upstream_and_releases(gated, admission, upstreams):
    for fake in upstreams:
        fake.chunk_delay = 0.5
        fake.chunks = 50
    resp = await gated.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-session-id": "dc"})
    await resp.content.readany()
    fake = next(f for f in upstreams if f.name == resp.headers["x-kvgate-replica"])
    resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(fake.cancelled_event.wait(), timeout=5)
    for _ in range(100):
        if admission.leases[0].releases:
            break
        await asyncio.sleep(0.02)
    assert admission.leases[0].releases == 1
    assert gated.app.registry.get(fake.name).in_flight == 0
    text = await (await gated.get("/metrics")).text()
    assert 'kind="client_disconnect"' in text


async def test_lease_released_on_upstream_failure_and_reacquired_on_failover(gated, admission, upstreams):
    first = (await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "ff"})).headers[
        "x-kvgate-replica"
    ]
    await next(f for f in upstreams if f.name == first).refuse()
    resp = await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "ff"})
    assert resp.status == 200
    assert resp.headers["x-kvgate-replica"] != first
    assert [lease.releases for lease in admission.leases] == [1, 1, 1]
    assert [a[0] for a in admission.acquired] == [first, first, resp.headers["x-kvgate-replica"]]


async def test_finish_header_finishes_the_session_after_the_turn(gated, admission):
    await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "fin"})
    assert admission.finished == []
    await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "fin", "x-session-finish": "true"})
    assert admission.finished == ["fin"]
    await gated.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "fin", "x-session-finish": "no"})
    assert admission.finished == ["fin"]


async def test_admin_finish_and_state_use_the_controller(gated, admission):
    resp = await gated.post("/admin/sessions/abc/finish", headers=ADMIN)
    assert resp.status == 200
    assert admission.finished == ["abc"]
    state = await (await gated.get("/admin/state", headers=ADMIN)).json()
    assert state["gates"] == admission.state()
    assert {r["name"] for r in state["replicas"]} == {"r0", "r1"}


async def test_admin_remove_replica_tells_the_controller(gated, admission):
    resp = await gated.delete("/admin/replicas/r0", headers=ADMIN)
    assert resp.status == 200
    assert admission.removed == ["r0"]


async def test_real_gate_controller_admits_through_the_proxy(upstreams, make_proxy):
    """The gate's AdmissionController plugged into the app factory (fakes have low usage)."""
    from kvgate.gate.admission import AdmissionController
    from kvgate.gate.settings import GateSettings
    from kvgate.proxy.metrics import KvgateMetrics

    metrics = KvgateMetrics()
    controller = AdmissionController(GateSettings(), metrics.gate)
    client = await make_proxy(upstreams, admission=controller)
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "real"})
    assert resp.status == 200
    assert resp.headers["x-kvgate-admission"]
