"""The hot path: resolve the session, route, admit, forward, relay, release.

Invariants:
- The request body (read whole and bounded by the server) is parsed once.
- Every acquired lease is released exactly when the relay ends: response fully
  written, client gone, or upstream failed. `replica.in_flight` is incremented after
  admission and decremented on the same paths.
- A client that disconnects cancels the handler: a pending acquire is cancelled, an
  upstream request is closed at once (its connection is dropped, never pooled, so
  vLLM aborts the generation).
- Response bodies are relayed byte for byte; SSE chunks are written as they arrive.
- Re-routing happens at most once for `ReplicaUnavailable` and at most once for a
  connection that could not be opened (the request never reached the replica).
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter, Histogram

from kvgate.balancer import Balancer, Replica
from kvgate.gate.errors import AdmissionError, ReplicaUnavailable
from kvgate.proxy.errors import RequestRejected, send_error, sse_error_event
from kvgate.proxy.http_server import HttpRequest, Responder
from kvgate.proxy.metrics import KvgateMetrics, turn_bucket
from kvgate.proxy.request_body import parse_json_object, stream_flag, with_member
from kvgate.proxy.response_chains import TurnPlan, plan_turn
from kvgate.proxy.session_id import resolve_session_id, split_body_fields
from kvgate.proxy.session_tracker import SessionTracker
from kvgate.proxy.settings import Settings
from kvgate.proxy.topology import FRONT_DOOR, REPLICA_GATE, merge_kvgate_headers, with_session_header
from kvgate.proxy.upstream import (
    CONNECT_ERRORS,
    EXCHANGE_ERRORS,
    UpstreamClients,
    relayed_response_headers,
    upstream_request_headers,
)
from kvgate.wire.routes import PROMPT_KINDS, SESSION_FIELD_KINDS, RouteSpec

log = logging.getLogger("kvgate.proxy")

H_REPLICA = b"x-kvgate-replica"
H_ADMISSION = b"x-kvgate-admission"
H_WAIT = b"x-kvgate-wait-ms"
CLIENT_CLOSED = 499  # the status label of a request whose client went away (nginx's convention)


def format_wait_ms(wait_ms: float) -> bytes:
    return b"0" if not wait_ms else f"{wait_ms:.1f}".encode()


def lease_headers(replica: Replica, lease) -> list[tuple[bytes, bytes]]:
    return [
        (H_REPLICA, replica.name.encode()),
        (H_ADMISSION, str(lease.reason).encode()),
        (H_WAIT, format_wait_ms(lease.wait_ms)),
    ]


def retry_after(seconds: float | None) -> list[tuple[bytes, bytes]]:
    if seconds is None:
        return []
    return [(b"Retry-After", str(max(1, int(seconds + 0.999))).encode())]


class Forwarder:
    def __init__(
        self,
        settings: Settings,
        balancer: Balancer,
        admission,
        clients: UpstreamClients,
        metrics: KvgateMetrics,
        sessions: SessionTracker,
    ) -> None:
        self.balancer = balancer
        self.registry = balancer.registry
        self.admission = admission
        self.clients = clients
        self.metrics = metrics
        self.sessions = sessions
        self._fields = split_body_fields(settings.session.body_fields)
        self._header = settings.session.header.lower()
        self._finish_header = settings.session.finish_header.lower()
        self._forward_session_id = settings.session.forward_session_id
        self._api_key = settings.upstream.api_key
        self._max_buffered = settings.limits.max_buffered_response_bytes
        self._front_door = settings.role == FRONT_DOOR  # the session id travels on in the header
        self._tiered = settings.role in (FRONT_DOOR, REPLICA_GATE)
        self._gates = settings.gate.mode != "off"
        self._double_gating_warned: set[str] = set()
        self._counters: dict[tuple[str, str, int], Counter] = {}  # labelled children, looked up once
        self._turn_children: dict[str, Histogram] = {}

    # ---- the request --------------------------------------------------------------

    async def forward(
        self, request: HttpRequest, responder: Responder, route: RouteSpec, path_session_id: str | None
    ) -> None:
        started = time.perf_counter()
        kind = route.kind
        try:
            if route.has_body:
                body = parse_json_object(request.body)
                stream = stream_flag(body)
                raw = request.body
            else:
                raw, body, stream = None, {}, False
            session_id = resolve_session_id(path_session_id, request.headers, self._header, body, self._fields)
            chain = plan_turn(body, session_id, self.sessions.responses.lookup) if kind == "responses" else None
        except RequestRejected as exc:
            self._count(kind, "none", exc.status)
            send_error(responder, exc.status, exc.message, exc.code)
            return
        if chain is not None:
            session_id = chain.session_id
            if chain.set_request_id:  # vLLM answers with id = request_id: the link is known up front
                assert raw is not None and chain.response_id is not None  # a Responses body, to be stored
                raw = with_member(raw, body, "request_id", chain.response_id)
                body["request_id"] = chain.response_id

        if session_id is None:
            await self._relay_turn(request, responder, route, raw, body, stream, None, None, started, chain)
            return
        if self._forward_session_id and kind in SESSION_FIELD_KINDS and "session_id" not in body:
            assert raw is not None  # SESSION_FIELD_KINDS are routes with a body
            raw = with_member(raw, body, "session_id", session_id)
            body["session_id"] = session_id
        entry = self.sessions.touch(session_id)
        if chain is not None and chain.link is not None:
            entry.replica = chain.link.replica  # the replica that holds the continued response
        finish = request.headers.get(self._finish_header, "").lower() == "true"
        try:
            await self._relay_turn(request, responder, route, raw, body, stream, session_id, entry, started, chain)
        finally:
            if finish:
                self.admission.finish_session(session_id)
                self.sessions.forget(session_id)

    def _route(self, session_id: str | None, entry) -> Replica | None:
        if entry is not None:
            pinned = entry.replica
            if pinned is not None and pinned.healthy and not pinned.removed:
                return pinned
        return self.balancer.choose(session_id)

    async def _relay_turn(
        self,
        request: HttpRequest,
        responder: Responder,
        route: RouteSpec,
        raw,
        body,
        stream: bool,
        session_id,
        entry,
        started: float,
        chain: TurnPlan | None = None,
    ) -> None:
        kind = route.kind
        replica = self._route(session_id, entry)
        if replica is None:
            self._no_replica(responder, kind)
            return
        turn_index = entry.turns + 1 if entry is not None else 0
        headers = upstream_request_headers(request.raw_headers, self._api_key)
        if self._front_door and session_id is not None:
            headers = with_session_header(headers, self._header.encode(), session_id)
        target = f"{route.path}?{request.query}" if request.query else route.path
        rerouted_unavailable = rerouted_connect = False
        while True:
            try:
                lease = await self.admission.acquire(replica, session_id, kind, body)
            except asyncio.CancelledError:  # the client left while waiting at the gate
                self.metrics.upstream_errors.labels(replica.name, "client_disconnect").inc()
                self._count(kind, replica.name, CLIENT_CLOSED)
                raise
            except AdmissionError as refusal:
                if isinstance(refusal, ReplicaUnavailable) and not rerouted_unavailable:
                    rerouted_unavailable = True
                    replica = self.balancer.choose(session_id, exclude=replica)
                    if replica is None:
                        self._no_replica(responder, kind)
                        return
                    continue
                self._count(kind, replica.name, refusal.status)
                send_error(
                    responder,
                    refusal.status,
                    refusal.message,
                    refusal.code,
                    [(H_REPLICA, replica.name.encode()), *retry_after(refusal.retry_after)],
                    type_=refusal.error_type,
                )
                return

            replica.in_flight += 1
            try:
                upstream = await self.clients.for_replica(replica).request(route.method, target, headers, raw)
            except CONNECT_ERRORS as exc:
                replica.in_flight -= 1
                lease.release(served=False)  # no prompt served: the turn leaves no new window
                # Tiers: a replica with other requests in flight is alive, only slow to accept (an
                # overloaded replica gate): not marked failed, and this request (which never reached
                # it) is re-sent to it once rather than moving the session (proxy/topology.py).
                busy = self._tiered and replica.in_flight > 0
                if not busy:
                    self.registry.mark_failed(replica)
                self.metrics.upstream_errors.labels(replica.name, "connect").inc()
                other = (
                    None if rerouted_connect else replica if busy else self.balancer.choose(session_id, exclude=replica)
                )
                if other is not None:
                    rerouted_connect = True
                    replica = other
                    continue
                self._count(kind, replica.name, 502)
                send_error(
                    responder,
                    502,
                    f"could not connect to replica {replica.name} ({exc}); it is marked "
                    "unhealthy until its health checks pass (unless it has requests in flight); retry later",
                    "upstream_connect_failed",
                    lease_headers(replica, lease),
                )
                return
            except EXCHANGE_ERRORS as exc:
                replica.in_flight -= 1
                lease.release(served=False)
                self.metrics.upstream_errors.labels(replica.name, "before_headers").inc()
                self._count(kind, replica.name, 502)
                send_error(
                    responder,
                    502,
                    f"replica {replica.name} failed before answering ({exc}); retry the request",
                    "upstream_failed",
                    lease_headers(replica, lease),
                )
                return
            except BaseException:
                replica.in_flight -= 1
                lease.release(served=False)
                raise
            break

        if replica.health.fail_streak:
            self.registry.record_answer(replica)
        if entry is not None:
            entry.replica = replica
        status = CLIENT_CLOSED
        completed = False
        try:
            status, completed = await self._relay(responder, upstream, replica, lease, stream, kind)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.upstream_errors.labels(replica.name, "client_disconnect").inc()
            raise
        finally:
            if not completed:
                upstream.close()  # drop the connection: vLLM sees the disconnect and aborts
            replica.in_flight -= 1
            lease.release(served=upstream.status < 400)  # an error answer (404...) served no prompt
            self._count(kind, replica.name, status)
        if status >= 400 or not completed:
            return
        if turn_index and kind in PROMPT_KINDS:
            entry.turns = turn_index
            self._observe_turn(turn_index, time.perf_counter() - started)
        if chain is not None and chain.response_id is not None:
            assert chain.chain_session is not None  # TurnPlan: set whenever response_id is
            self.sessions.responses.record(chain.response_id, chain.chain_session, replica)

    # ---- relaying the response --------------------------------------------------

    async def _relay(
        self, responder: Responder, upstream, replica: Replica, lease, stream: bool, kind: str
    ) -> tuple[int, bool]:
        """Relay the upstream's answer: (status for metrics, completed normally)."""
        headers, upstream_gated = merge_kvgate_headers(
            relayed_response_headers(upstream.headers), lease_headers(replica, lease)
        )
        if upstream_gated and self._gates and replica.name not in self._double_gating_warned:
            self._double_gating_warned.add(replica.name)
            log.error(
                "replica %s answers with x-kvgate-* headers: it is a kvgate, and this kvgate gates it a "
                "second time; give this one role: front_door with gate.mode: off (docs/ARCHITECTURE.md)",
                replica.name,
            )
        is_sse = upstream.content_type == b"text/event-stream"
        pending: list[bytes] = []
        if not (is_sse or (stream and upstream.content_length is None)):
            # Buffered, so that an upstream failing mid-body still gets a clean 502; past
            # limits.max_buffered_response_bytes the answer is relayed as it arrives.
            size = 0
            while size <= self._max_buffered:
                try:
                    data = await upstream.readany()
                except EXCHANGE_ERRORS as exc:
                    self.metrics.upstream_errors.labels(replica.name, "mid_body").inc()
                    send_error(
                        responder,
                        502,
                        f"replica {replica.name} broke off its response ({exc}); retry the request",
                        "upstream_failed",
                        lease_headers(replica, lease),
                    )
                    return 502, False
                if not data:
                    responder.send(upstream.status, b"".join(pending), headers, upstream.reason)
                    return upstream.status, True
                pending.append(data)
                size += len(data)

        await responder.start(upstream.status, headers, upstream.reason, None if is_sse else upstream.content_length)
        for data in pending:
            await responder.write(data)
        pending.clear()
        while True:
            try:
                chunk = await upstream.readany()
            except EXCHANGE_ERRORS as exc:
                self.metrics.upstream_errors.labels(replica.name, "mid_stream").inc()
                if is_sse:
                    await responder.write(
                        sse_error_event(
                            f"replica {replica.name} broke off the stream ({exc}); the answer is incomplete, "
                            "retry the request",
                            "upstream_stream_broken",
                            anthropic=kind == "messages",
                        )
                    )
                    await responder.end()
                # else: the response stays unfinished, so the server closes the connection
                # and the client cannot take a truncated body for a complete one.
                return upstream.status, False
            if not chunk:
                break
            await responder.write(chunk)
        await responder.end()
        return upstream.status, True

    # ---- helpers ---------------------------------------------------------------------

    def _count(self, kind: str, replica: str, status: int) -> None:
        key = (kind, replica, status)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self.metrics.requests.labels(kind, replica, str(status))
        child.inc()

    def _observe_turn(self, turn_index: int, seconds: float) -> None:
        label = turn_bucket(turn_index)
        child = self._turn_children.get(label)
        if child is None:
            child = self._turn_children[label] = self.metrics.turn_seconds.labels(label)
        child.observe(seconds)

    def _no_replica(self, responder: Responder, kind: str) -> None:
        self._count(kind, "none", 503)
        send_error(
            responder,
            503,
            "no healthy replica is available; check the replicas' /health and GET /admin/state, then retry",
            "no_healthy_replica",
            [(b"Retry-After", b"1")],
        )
