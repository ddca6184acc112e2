"""The hot path: read, resolve the session, route, admit, forward, relay, release.

Invariants:
- The request body is read once (bounded by `limits.max_body_bytes`) and parsed once.
- Every acquired lease is released exactly when the relay ends: response fully
  written, client gone, or upstream failed. `replica.in_flight` is incremented after
  admission and decremented on the same paths.
- A client that disconnects cancels the handler (the server runs with handler
  cancellation): a pending acquire is cancelled, an upstream request is closed at
  once (its connection is dropped, never pooled, so vLLM aborts the generation).
- Response bodies are relayed byte for byte; SSE chunks are written as they arrive.
- Re-routing happens at most once for `ReplicaUnavailable` and at most once for a
  connection that could not be opened (the request never reached the replica).
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from aiohttp import web

from balancer import Balancer, Replica
from proxy.admission_errors import as_refusal, retry_after_header
from proxy.errors import RequestRejected, error_response, sse_error_event
from proxy.metrics import KvgateMetrics, turn_bucket
from proxy.request_body import parse_json_object, stream_flag
from proxy.routes import SESSION_FIELD_KINDS, TURN_KINDS, RouteSpec
from proxy.session_id import resolve_session_id, split_body_fields
from proxy.session_tracker import SessionTracker
from proxy.settings import Settings
from proxy.upstream import (CONNECT_ERRORS, EXCHANGE_ERRORS, UpstreamClients, relayed_response_headers,
                            upstream_request_headers)

log = logging.getLogger("kvgate.proxy")

H_REPLICA = "x-kvgate-replica"
H_ADMISSION = "x-kvgate-admission"
H_WAIT = "x-kvgate-wait-ms"
CLIENT_CLOSED = 499  # the status label of a request whose client went away (nginx's convention)


def format_wait_ms(wait_ms: float) -> str:
    return "0" if not wait_ms else f"{wait_ms:.1f}"


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed `max_bytes`."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise RequestRejected(413, f"request body of {length} bytes exceeds limits.max_body_bytes "
                              f"({max_bytes}); send a smaller body or raise the limit", "body_too_large")
    content = request.content
    chunks = []
    size = 0
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > max_bytes:
            raise RequestRejected(413, f"request body exceeds limits.max_body_bytes ({max_bytes}); "
                                  "send a smaller body or raise the limit", "body_too_large")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
        self._header = settings.session.header
        self._finish_header = settings.session.finish_header
        self._forward_session_id = settings.session.forward_session_id
        self._max_body = settings.limits.max_body_bytes
        self._api_key = settings.upstream.api_key
        self._counters: dict[tuple, object] = {}

    def handler_for(self, route: RouteSpec):
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.forward(request, route)
        handle.__name__ = f"forward_{route.kind}"
        return handle

    # ---- the request --------------------------------------------------------------

    async def forward(self, request: web.Request, route: RouteSpec) -> web.StreamResponse:
        started = time.perf_counter()
        kind = route.kind
        try:
            if route.has_body:
                raw = await read_body(request, self._max_body)
                body = parse_json_object(raw)
                stream = stream_flag(body)
            else:
                raw, body, stream = None, {}, False
            session_id = resolve_session_id(request.match_info.get("session_id"), request.headers,
                                            self._header, body, self._fields)
        except RequestRejected as exc:
            self._count(kind, "none", exc.status)
            response = error_response(exc.status, exc.message, exc.code)
            if exc.status == 413:
                response.force_close()  # the unread rest of the body makes the connection unusable
            return response

        if session_id is None:
            return await self._relay_turn(request, route, raw, body, stream, None, None, started)
        if self._forward_session_id and kind in SESSION_FIELD_KINDS and "session_id" not in body:
            body["session_id"] = session_id
            raw = orjson.dumps(body)
        entry = self.sessions.touch(session_id)
        finish = request.headers.get(self._finish_header, "").lower() == "true"
        try:
            return await self._relay_turn(request, route, raw, body, stream, session_id, entry, started)
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

    async def _relay_turn(self, request, route: RouteSpec, raw, body, stream, session_id, entry,
                          started: float) -> web.StreamResponse:
        kind = route.kind
        replica = self._route(session_id, entry)
        if replica is None:
            return self._no_replica(kind)
        turn_index = entry.turns + 1 if entry is not None else 0
        headers = upstream_request_headers(request.raw_headers, self._api_key)
        query = request.query_string
        rerouted_unavailable = rerouted_connect = False
        while True:
            try:
                lease = await self.admission.acquire(replica, session_id, kind, body)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                refusal = as_refusal(exc)
                if refusal is None:
                    raise
                if refusal.replica_unavailable and not rerouted_unavailable:
                    rerouted_unavailable = True
                    replica = self.balancer.choose(session_id, exclude=replica)
                    if replica is None:
                        return self._no_replica(kind)
                    continue
                self._count(kind, replica.name, refusal.status)
                extra = retry_after_header(refusal.retry_after) or {}
                extra[H_REPLICA] = replica.name
                return error_response(refusal.status, refusal.message, refusal.code, headers=extra,
                                      type_=refusal.error_type)

            replica.in_flight += 1
            try:
                upstream = await self.clients.for_replica(replica).request(
                    route.method, f"{route.path}?{query}" if query else route.path, headers, raw)
            except CONNECT_ERRORS as exc:
                replica.in_flight -= 1
                lease.release()
                self.registry.mark_failed(replica)
                self.metrics.upstream_errors.labels(replica.name, "connect").inc()
                other = None if rerouted_connect else self.balancer.choose(session_id, exclude=replica)
                if other is not None:
                    rerouted_connect = True
                    replica = other
                    continue
                self._count(kind, replica.name, 502)
                return self._bad_gateway(kind, replica, lease, "upstream_connect_failed",
                                         f"could not connect to replica {replica.name} ({exc}); it is marked "
                                         "unhealthy until its health checks pass; retry later")
            except EXCHANGE_ERRORS as exc:
                replica.in_flight -= 1
                lease.release()
                self.metrics.upstream_errors.labels(replica.name, "before_headers").inc()
                self._count(kind, replica.name, 502)
                return self._bad_gateway(kind, replica, lease, "upstream_failed",
                                         f"replica {replica.name} failed before answering "
                                         f"({type(exc).__name__}: {exc}); retry the request")
            except BaseException:
                replica.in_flight -= 1
                lease.release()
                raise
            break

        if entry is not None:
            entry.replica = replica
        status = CLIENT_CLOSED
        completed = False
        try:
            response, status, completed = await self._relay(request, upstream, replica, lease, stream, kind)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.upstream_errors.labels(replica.name, "client_disconnect").inc()
            raise
        finally:
            if not completed:
                upstream.close()  # drop the connection: vLLM sees the disconnect and aborts
            replica.in_flight -= 1
            lease.release()
            self._count(kind, replica.name, status)
            if completed and turn_index and kind in TURN_KINDS and status < 400:
                entry.turns = turn_index
                self.metrics.turn_seconds.labels(turn_bucket(turn_index)).observe(time.perf_counter() - started)

    # ---- relaying the response --------------------------------------------------

    async def _relay(self, request, upstream, replica, lease, stream: bool, kind: str):
        """(response, status for metrics, completed normally)."""
        headers = relayed_response_headers(upstream.headers)
        headers[H_REPLICA] = replica.name
        headers[H_ADMISSION] = lease.reason
        headers[H_WAIT] = format_wait_ms(lease.wait_ms)
        is_sse = upstream.content_type == "text/event-stream"
        if not (is_sse or (stream and upstream.content_length is None)):
            try:
                data = await upstream.read()
            except EXCHANGE_ERRORS as exc:
                self.metrics.upstream_errors.labels(replica.name, "mid_body").inc()
                return (self._bad_gateway(kind, replica, lease, "upstream_failed",
                                          f"replica {replica.name} broke off its response ({type(exc).__name__}); "
                                          "retry the request"), 502, False)
            return web.Response(status=upstream.status, reason=upstream.reason, body=data,
                                headers=headers), upstream.status, True

        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await response.prepare(request)
        while True:
            try:
                chunk = await upstream.readany()
            except EXCHANGE_ERRORS as exc:
                self.metrics.upstream_errors.labels(replica.name, "mid_stream").inc()
                if is_sse:
                    await response.write(sse_error_event(
                        f"replica {replica.name} broke off the stream ({type(exc).__name__}); "
                        "the answer is incomplete, retry the request", "upstream_stream_broken",
                        anthropic=kind == "messages"))
                    await response.write_eof()
                elif request.transport is not None:
                    request.transport.close()  # a truncated non-SSE body must not look complete
                return response, upstream.status, False
            if not chunk:
                break
            await response.write(chunk)
        await response.write_eof()
        return response, upstream.status, True

    # ---- helpers ---------------------------------------------------------------------

    def _count(self, kind: str, replica: str, status: int) -> None:
        key = (kind, replica, status)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self.metrics.requests.labels(kind, replica, str(status))
        child.inc()

    def _no_replica(self, kind: str) -> web.Response:
        self._count(kind, "none", 503)
        return error_response(503, "no healthy replica is available; check the replicas' /health and "
                              "GET /admin/state, then retry", "no_healthy_replica", headers={"Retry-After": "1"})

    def _bad_gateway(self, kind, replica, lease, code: str, message: str) -> web.Response:
        return error_response(502, message, code, headers={
            H_REPLICA: replica.name, H_ADMISSION: lease.reason, H_WAIT: format_wait_ms(lease.wait_ms)})
