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
import time

import orjson

from balancer import Balancer, Replica
from proxy.admission_errors import as_refusal
from proxy.errors import RequestRejected, send_error, sse_error_event
from proxy.http_server import HttpRequest, Responder
from proxy.metrics import KvgateMetrics, turn_bucket
from proxy.request_body import parse_json_object, stream_flag
from proxy.routes import SESSION_FIELD_KINDS, TURN_KINDS, RouteSpec
from proxy.session_id import resolve_session_id, split_body_fields
from proxy.session_tracker import SessionTracker
from proxy.settings import Settings
from proxy.upstream import (CONNECT_ERRORS, EXCHANGE_ERRORS, UpstreamClients, relayed_response_headers,
                            upstream_request_headers)

H_REPLICA = b"x-kvgate-replica"
H_ADMISSION = b"x-kvgate-admission"
H_WAIT = b"x-kvgate-wait-ms"
CLIENT_CLOSED = 499  # the status label of a request whose client went away (nginx's convention)


def format_wait_ms(wait_ms: float) -> bytes:
    return b"0" if not wait_ms else f"{wait_ms:.1f}".encode()


def lease_headers(replica: Replica, lease) -> list[tuple[bytes, bytes]]:
    return [(H_REPLICA, replica.name.encode()), (H_ADMISSION, str(lease.reason).encode()),
            (H_WAIT, format_wait_ms(lease.wait_ms))]


def retry_after(seconds: float | None) -> list[tuple[bytes, bytes]]:
    if seconds is None:
        return []
    return [(b"Retry-After", str(max(1, int(seconds + 0.999))).encode())]


class Forwarder:
    def __init__(self, settings: Settings, balancer: Balancer, admission, clients: UpstreamClients,
                 metrics: KvgateMetrics, sessions: SessionTracker) -> None:
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
        self._counters: dict[tuple, object] = {}
        self._turn_children: dict[str, object] = {}

    # ---- the request --------------------------------------------------------------

    async def forward(self, request: HttpRequest, responder: Responder, route: RouteSpec,
                      path_session_id: str | None) -> None:
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
        except RequestRejected as exc:
            self._count(kind, "none", exc.status)
            send_error(responder, exc.status, exc.message, exc.code)
            return

        if session_id is None:
            await self._relay_turn(request, responder, route, raw, body, stream, None, None, started)
            return
        if self._forward_session_id and kind in SESSION_FIELD_KINDS and "session_id" not in body:
            body["session_id"] = session_id
            raw = orjson.dumps(body)
        entry = self.sessions.touch(session_id)
        finish = request.headers.get(self._finish_header, "").lower() == "true"
        try:
            await self._relay_turn(request, responder, route, raw, body, stream, session_id, entry, started)
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

    async def _relay_turn(self, request: HttpRequest, responder: Responder, route: RouteSpec, raw, body,
                          stream: bool, session_id, entry, started: float) -> None:
        kind = route.kind
        replica = self._route(session_id, entry)
        if replica is None:
            self._no_replica(responder, kind)
            return
        turn_index = entry.turns + 1 if entry is not None else 0
        headers = upstream_request_headers(request.raw_headers, self._api_key)
        target = f"{route.path}?{request.query}" if request.query else route.path
        rerouted_unavailable = rerouted_connect = False
        while True:
            try:
                lease = await self.admission.acquire(replica, session_id, kind, body)
            except asyncio.CancelledError:  # the client left while waiting at the gate
                self.metrics.upstream_errors.labels(replica.name, "client_disconnect").inc()
                self._count(kind, replica.name, CLIENT_CLOSED)
                raise
            except Exception as exc:
                refusal = as_refusal(exc)
                if refusal is None:
                    raise
                if refusal.replica_unavailable and not rerouted_unavailable:
                    rerouted_unavailable = True
                    replica = self.balancer.choose(session_id, exclude=replica)
                    if replica is None:
                        self._no_replica(responder, kind)
                        return
                    continue
                self._count(kind, replica.name, refusal.status)
                send_error(responder, refusal.status, refusal.message, refusal.code,
                           [(H_REPLICA, replica.name.encode()), *retry_after(refusal.retry_after)],
                           type_=refusal.error_type)
                return

            replica.in_flight += 1
            try:
                upstream = await self.clients.for_replica(replica).request(route.method, target, headers, raw)
            except CONNECT_ERRORS as exc:
                replica.in_flight -= 1
                lease.release(served=False)  # no prompt served: the turn leaves no new window
                self.registry.mark_failed(replica)
                self.metrics.upstream_errors.labels(replica.name, "connect").inc()
                other = None if rerouted_connect else self.balancer.choose(session_id, exclude=replica)
                if other is not None:
                    rerouted_connect = True
                    replica = other
                    continue
                self._count(kind, replica.name, 502)
                send_error(responder, 502, f"could not connect to replica {replica.name} ({exc}); it is marked "
                           "unhealthy until its health checks pass; retry later", "upstream_connect_failed",
                           lease_headers(replica, lease))
                return
            except EXCHANGE_ERRORS as exc:
                replica.in_flight -= 1
                lease.release(served=False)
                self.metrics.upstream_errors.labels(replica.name, "before_headers").inc()
                self._count(kind, replica.name, 502)
                send_error(responder, 502, f"replica {replica.name} failed before answering ({exc}); "
                           "retry the request", "upstream_failed", lease_headers(replica, lease))
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
        if turn_index and kind in TURN_KINDS and status < 400 and completed:
            entry.turns = turn_index
            self._observe_turn(turn_index, time.perf_counter() - started)

    # ---- relaying the response --------------------------------------------------

    async def _relay(self, responder: Responder, upstream, replica: Replica, lease, stream: bool,
                     kind: str) -> tuple[int, bool]:
        """Relay the upstream's answer: (status for metrics, completed normally)."""
        headers = relayed_response_headers(upstream.headers)
        headers += lease_headers(replica, lease)
        is_sse = upstream.content_type == b"text/event-stream"
        if not (is_sse or (stream and upstream.content_length is None)):
            try:
                data = await upstream.read()
            except EXCHANGE_ERRORS as exc:
                self.metrics.upstream_errors.labels(replica.name, "mid_body").inc()
                send_error(responder, 502, f"replica {replica.name} broke off its response ({exc}); "
                           "retry the request", "upstream_failed", lease_headers(replica, lease))
                return 502, False
            responder.send(upstream.status, data, headers, upstream.reason)
            return upstream.status, True

        await responder.start(upstream.status, headers, upstream.reason)
        while True:
            try:
                chunk = await upstream.readany()
            except EXCHANGE_ERRORS as exc:
                self.metrics.upstream_errors.labels(replica.name, "mid_stream").inc()
                if is_sse:
                    await responder.write(sse_error_event(
                        f"replica {replica.name} broke off the stream ({exc}); the answer is incomplete, "
                        "retry the request", "upstream_stream_broken", anthropic=kind == "messages"))
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
        send_error(responder, 503, "no healthy replica is available; check the replicas' /health and "
                   "GET /admin/state, then retry", "no_healthy_replica", [(b"Retry-After", b"1")])
