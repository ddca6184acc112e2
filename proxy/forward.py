"""The hot path: resolve the session, then route, admit and relay the turn.

The steps: `forward` resolves the request (body, session, Responses chain) into a
`Turn`; `_run` routes it (proxy.turn_route: the pinned replica, where a failed turn
goes again), admits it (the gate's lease), opens the upstream request and relays the
answer (proxy.relay).

Invariants:
- The request body (read whole and bounded by the server) is parsed once.
- An admitted request's place in `replica.in_flight` and its lease are held by one
  `proxy.turn_hold.Hold` block: given back exactly once when the relay ends
  (response fully written, client gone, or upstream failed).
- A client that disconnects cancels the handler: a pending acquire is cancelled, an
  upstream request is closed at once (its connection is dropped, never pooled, so
  vLLM aborts the generation).
- Re-routing happens at most once for `ReplicaUnavailable` and at most once for a
  connection that could not be opened (the request never reached the replica).
- A turn the gate holds moves at most once, to another routable replica with nothing
  to do (`SessionRelocated`, `gate/relocation.py`); its session sticks where it is served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from kvgate.balancer import Balancer, Replica
from kvgate.gate.errors import AdmissionError, ReplicaUnavailable, SessionRelocated
from kvgate.proxy.access_log import LOGGER as ACCESS_LOGGER
from kvgate.proxy.access_log import access_line
from kvgate.proxy.errors import RequestRejected, clipped, send_error
from kvgate.proxy.http_client import UpstreamResponse
from kvgate.proxy.http_fields import decode_path_segment
from kvgate.proxy.http_server import HttpRequest, Responder
from kvgate.proxy.metrics import KvgateMetrics, turn_bucket
from kvgate.proxy.relay import H_REPLICA, AnswerRelay, lease_headers
from kvgate.proxy.reply_end import ReplyEnd, leaves_tools_to_model
from kvgate.proxy.request_body import (
    parse_json_object,
    passthrough_body,
    stream_flag,
    with_kv_pin,
    with_member,
    with_priority,
    without_kv_pin,
)
from kvgate.proxy.response_chains import ChainLink, TurnPlan, plan_turn
from kvgate.proxy.session_id import resolve_session_id, split_body_fields
from kvgate.proxy.session_tracker import SessionEntry, SessionTracker
from kvgate.proxy.settings import Settings
from kvgate.proxy.tenancy import scoped_session, visible
from kvgate.proxy.topology import FRONT_DOOR, REPLICA_GATE, TIER_SESSION_HEADER, with_session_header
from kvgate.proxy.turn_hold import UNGATED, Hold, TurnAdmission, TurnLease
from kvgate.proxy.turn_route import Failure, Resend, after_failure, moved_to, others, pinned_replica
from kvgate.proxy.upstream import (
    CONNECT_ERRORS,
    EXCHANGE_ERRORS,
    UpstreamClients,
    upstream_request_headers,
)
from kvgate.proxy.usage_tap import ASKED_USAGE_KINDS, USAGE_KINDS, USAGE_OPTION, UsageTap, asks_for_usage
from kvgate.wire.routes import PASSTHROUGH, PROMPT_KINDS, SESSION_FIELD_KINDS, RouteSpec, response_id_of

CLIENT_CLOSED = 499  # the status label of a request whose client went away (nginx's convention)


def retry_after(seconds: float | None) -> list[tuple[bytes, bytes]]:
    if seconds is None:
        return []
    return [(b"Retry-After", str(max(1, int(seconds + 0.999))).encode())]


@dataclass(slots=True)
class Turn:
    """One resolved request, as the steps that route, admit and relay it read it."""

    request: HttpRequest
    responder: Responder
    route: RouteSpec
    raw: bytes | None  # the body to send upstream (None: a route without a body)
    body: dict[str, object]  # `raw` parsed ({} without a body); the gate reads it
    stream: bool
    session_id: str | None  # None: anonymous
    entry: SessionEntry | None  # the session's memory (None: anonymous)
    index: int  # the turn's number in its session (0: anonymous)
    started: float  # perf_counter() when the request arrived
    chain: TurnPlan | None  # a Responses request's place in its chain
    headers: list[tuple[bytes, bytes]]  # the upstream request's headers
    target: str  # the upstream request's path and query
    strip_usage: bool = False  # kvgate asked for the answer's usage: the client did not (proxy.usage_tap)
    # what happened, for the access log: the replica last chosen, the gate's answer, its wait
    replica: str | None = None
    admission: str | None = None
    wait_ms: float = 0.0


@dataclass(slots=True)
class _Read:
    """A request as read, before its turn exists: the body and the session it names."""

    raw: bytes | None  # the body to send upstream (None: a route without a body)
    body: dict[str, object]  # `raw` parsed ({} without a body)
    stream: bool
    session_id: str | None  # None: anonymous
    link: ChainLink | None  # the stored response the path names (passthrough routes)
    chain: TurnPlan | None  # a Responses request's place in its chain

    def with_member(self, name: str, value: object) -> None:
        """Add a member kvgate sets to both the bytes forwarded and the parsed body."""
        assert self.raw is not None  # only a route with a body gets members
        self.raw = with_member(self.raw, self.body, name, value)
        self.body[name] = value


class Forwarder:
    def __init__(
        self,
        settings: Settings,
        balancer: Balancer,
        admission: TurnAdmission,
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
        self._sessions_on = admission.placement()  # None: the balancer's algorithm places new sessions
        self._fields = split_body_fields(settings.session.body_fields)
        self._header = settings.session.header.lower()
        # kvgate's own header first, then the agent clients' own (session.client_headers)
        self._headers = (self._header, *(h.lower() for h in settings.session.client_headers))
        self._finish_header = settings.session.finish_header.lower()
        self._forward_session_id = settings.session.forward_session_id
        self._api_key = settings.upstream.api_key
        self._drop_client_keys = bool(settings.auth.api_keys)  # the client's kvgate key goes no further
        self._replica_gate = settings.role == REPLICA_GATE  # reads the front doors' TIER_SESSION_HEADER first
        self._front_door = settings.role == FRONT_DOOR  # the session id travels on in the header
        self._tiered = settings.role in (FRONT_DOOR, REPLICA_GATE)
        self._learns_usage = settings.gate.mode != "off"  # the gate learns each turn's prompt size from its usage
        self._ends_runs = self._learns_usage and settings.session.finish_on_final_reply  # (proxy.reply_end)
        self.relay = AnswerRelay(
            metrics, settings.limits.max_buffered_response_bytes, gates=settings.gate.mode != "off"
        )
        self._counters: dict[tuple[str, str, int], Counter] = {}  # labelled children, looked up once
        self._access = logging.getLogger(ACCESS_LOGGER) if settings.log.access else None
        self._turn_children: dict[str, Histogram] = {}

    # ---- the request --------------------------------------------------------------

    async def forward(
        self, request: HttpRequest, responder: Responder, route: RouteSpec, path_session_id: str | None
    ) -> None:
        """One request: read it (a bad one is answered here), attach its session, then run
        the turn; the access line and a finished session's end come after, whatever happens."""
        started = time.perf_counter()
        try:
            read = self._read_request(request, route, path_session_id)
        except RequestRejected as exc:
            self._count(route.kind, "none", exc.status)
            send_error(responder, exc.status, exc.message, exc.code)
            if self._access is not None:
                self._log_access(route.kind, None, None, exc.status, started, exc.code)
            return
        entry, finish = self._attach_session(read, request, route.kind)
        turn = self._build_turn(read, request, responder, route, entry, started)
        status = CLIENT_CLOSED
        try:
            await self._run(turn)
            status = responder.status or CLIENT_CLOSED
        finally:
            if self._access is not None:
                self._log_access(turn.route.kind, read.session_id, turn, status, started)
            if finish:
                assert read.session_id is not None  # only a named session can be finished
                self.admission.finish_session(read.session_id)
                self.sessions.forget(read.session_id)

    def _read_request(self, request: HttpRequest, route: RouteSpec, path_session_id: str | None) -> _Read:
        """The request's body, stream flag and session id, with the stored response or the
        Responses chain it names (RequestRejected: answered with its status, never forwarded)."""
        kind = route.kind
        raw: bytes | None
        link = None
        if kind == PASSTHROUGH:  # relayed as sent: vLLM judges the body; kvgate reads what it can
            raw = request.body or None
            body = passthrough_body(raw)
            stream = body.get("stream") is True
            response_id = response_id_of(route.path)
            if response_id is not None:
                response_id = decode_path_segment(response_id, "response id")
                link = self._stored_response(response_id, request.tenant)
        elif route.has_body:
            body = parse_json_object(request.body)
            stream = stream_flag(body)
            raw = request.body
        else:
            raw, body, stream = None, {}, False
        if raw is not None:  # only gates pin KV: a client's pin never reaches a replica
            raw, body = without_kv_pin(raw, body)
        headers_read = self._headers
        if self._replica_gate and TIER_SESSION_HEADER in request.headers:
            headers_read = (TIER_SESSION_HEADER,)  # the id its front door resolved
        try:
            session_id = resolve_session_id(path_session_id, request.headers, headers_read, body, self._fields)
        except RequestRejected:
            if kind != PASSTHROUGH:
                raise
            # on a route kvgate does not define, a body field of another type is no session id
            session_id = resolve_session_id(path_session_id, request.headers, headers_read, None, self._fields)
        session_id = scoped_session(request.tenant, session_id)  # a tenant's ids are its own
        chain = self._plan_chain(body, session_id, request.tenant) if kind == "responses" else None
        return _Read(raw, body, stream, session_id, link, chain)

    def _attach_session(self, read: _Read, request: HttpRequest, kind: str) -> tuple[SessionEntry | None, bool]:
        """Settle the request's session (a stored response's or a chain's wins), write the
        members kvgate adds to the body, and touch the session: its entry, and whether this
        turn finishes it."""
        if read.link is not None:  # a stored response: its session, on the replica that holds it
            read.session_id = read.link.session_id
        chain = read.chain
        if chain is not None:
            read.session_id = chain.session_id
            if chain.set_request_id:  # vLLM answers with id = request_id: the link is known up front
                assert read.raw is not None and chain.response_id is not None  # a Responses body, to be stored
                read.with_member("request_id", chain.response_id)
        entry = None
        finish = False
        session_id = read.session_id
        if session_id is not None:
            if self._forward_session_id and kind in SESSION_FIELD_KINDS and "session_id" not in read.body:
                read.with_member("session_id", session_id)  # SESSION_FIELD_KINDS are routes with a body
            entry = self.sessions.touch(session_id)
            if chain is not None and chain.link is not None:
                entry.replica = chain.link.replica  # the replica that holds the continued response
            elif read.link is not None:
                entry.replica = read.link.replica
            # Only a turn ends its session: a models list that anyone can send with any session
            # id must not end another session's window.
            finish = kind in PROMPT_KINDS and request.headers.get(self._finish_header, "").lower() == "true"
        return entry, finish

    def _build_turn(
        self,
        read: _Read,
        request: HttpRequest,
        responder: Responder,
        route: RouteSpec,
        entry: SessionEntry | None,
        started: float,
    ) -> Turn:
        """The turn to run: the body as forwarded (usage asked for when the gate learns from
        it; the client still gets the answer it asked for) and the upstream headers."""
        strip_usage = self._learns_usage and route.kind in ASKED_USAGE_KINDS and asks_for_usage(read.body)
        if strip_usage:  # the body keeps what the client sent: only the forwarded bytes ask
            assert read.raw is not None  # ASKED_USAGE_KINDS are routes with a body
            read.raw = with_member(read.raw, read.body, "stream_options", USAGE_OPTION)
        session_id = read.session_id
        return Turn(
            request,
            responder,
            route,
            read.raw,
            read.body,
            read.stream,
            session_id,
            entry,
            entry.turns + 1 if entry is not None else 0,
            started,
            read.chain,
            self._upstream_headers(request, session_id, self._api_key),
            f"{route.path}?{request.query}" if request.query else route.path,
            strip_usage,
        )

    def _stored_response(self, response_id: str, tenant: str | None, field: str = "") -> ChainLink | None:
        """The link of a stored response a request names (None: kvgate did not see it). With
        several tenants, one that is not the caller's (or unknown) is 404: a tenant can
        neither read nor continue another's response, nor learn that it exists."""
        link = self.sessions.responses.lookup(response_id)
        if tenant is None or (link is not None and visible(link.tenant, tenant)):
            return link
        where = f"{field} " if field else ""
        raise RequestRejected(
            404,
            f"the response {where}{clipped(response_id)!r} is not one this client key made through this kvgate; "
            "name a response your own turns stored",
            "response_not_found",
        )

    def _plan_chain(self, body: dict, session_id: str | None, tenant: str | None) -> TurnPlan:
        """A Responses turn's plan (proxy.response_chains): its previous response must be the
        tenant's own, and a response id it chose must not be linked to another session (409,
        before forwarding: the replica would store the answer under that id)."""
        chain = plan_turn(
            body,
            session_id,
            lambda previous: self._stored_response(previous, tenant, "previous_response_id"),
            scope=lambda chain_session: scoped_session(tenant, chain_session) or chain_session,
        )
        if (
            chain.response_id is not None
            and not chain.set_request_id
            and self.sessions.responses.taken(chain.response_id, chain.chain_session, tenant)
        ):
            raise RequestRejected(
                409,
                f"request_id {clipped(chain.response_id)!r} already names a response of another session; "
                "choose a fresh request_id (or leave it out: kvgate picks one)",
                "response_id_taken",
            )
        return chain

    def _upstream_headers(
        self, request: HttpRequest, session_id: str | None, api_key: str | None
    ) -> list[tuple[bytes, bytes]]:
        """The client's headers as a replica gets them: with `api_key`, without the client's own
        kvgate key, and with the session for the next tier on a front door."""
        headers = upstream_request_headers(request.raw_headers, api_key, self._drop_client_keys)
        if self._front_door:
            headers = with_session_header(headers, session_id)
        return headers

    def _headers_for(self, turn: Turn, replica: Replica) -> list[tuple[bytes, bytes]]:
        """`turn.headers`, or without the upstream key for a replica that gets no credentials
        (added at run time from a host off `upstream.credential_hosts`: proxy/client_auth.py)."""
        if replica.credentials or not self._api_key:
            return turn.headers
        return self._upstream_headers(turn.request, turn.session_id, None)

    # ---- the turn's steps: route, admit, relay --------------------------------------

    def _place(self, turn: Turn) -> Replica | None:
        """The replica for a turn its session's pin does not place, pinned at once: placed by
        the gates' books, a session's concurrent first turns would otherwise be counted apart."""
        replica = self._choose(turn.session_id)
        if replica is not None and turn.entry is not None:
            turn.entry.replica = replica
        return replica

    def _choose(self, session_id: str | None, exclude: Replica | None = None) -> Replica | None:
        """The balancer's replica for a turn the session's pin does not place (a new session,
        or a re-send): where the gates' books count sessions, the one with the fewest."""
        return self.balancer.choose(session_id, exclude, self._sessions_on)

    async def _run(self, turn: Turn) -> None:
        """Route, admit, open, relay. A turn is re-sent at most once per kind of failure
        (proxy.turn_route); its place and lease on a replica are held by one `Hold`
        block, so every way out of it gives them back exactly once."""
        kind = turn.route.kind
        replica = pinned_replica(turn.entry) or self._place(turn)
        spent: frozenset[Failure] = frozenset()
        while True:
            if replica is None:
                self._no_replica(turn.responder, kind)
                return
            turn.replica = replica.name
            replica, lease = await self._admit(turn, replica)
            if isinstance(lease, AdmissionError):
                turn.admission = lease.code
                if isinstance(lease, ReplicaUnavailable):
                    then = after_failure(Failure.UNAVAILABLE, spent, self._tiered, replica.in_flight)
                    if then.resend is Resend.OTHER:
                        spent |= {Failure.UNAVAILABLE}
                        replica = self._choose(turn.session_id, exclude=replica)
                        continue
                self._refuse(turn, replica, lease)
                return
            turn.admission, turn.wait_ms = lease.reason or None, lease.wait_ms
            with Hold(replica, lease) as held:
                try:
                    upstream = await self.clients.for_replica(replica).request(
                        turn.route.method, turn.target, self._headers_for(turn, replica), _forwarded_body(turn, lease)
                    )
                except CONNECT_ERRORS as exc:
                    held.release()  # before deciding: `in_flight` then counts the replica's other requests
                    resend = self._after_connect_failure(turn, replica, lease, spent, exc)
                    if resend is None:
                        return
                    spent |= {Failure.CONNECT}
                    replica = resend
                    continue
                except EXCHANGE_ERRORS as exc:
                    self.metrics.upstream_errors.labels(replica.name, "before_headers").inc()
                    self._count(kind, replica.name, 502)
                    send_error(
                        turn.responder,
                        502,
                        f"replica {replica.name} failed before answering ({exc}); retry the request",
                        "upstream_failed",
                        lease_headers(replica, lease),
                    )
                    return
                except asyncio.CancelledError:  # the client left before the replica's headers came
                    self.metrics.upstream_errors.labels(replica.name, "client_disconnect").inc()
                    self._count(kind, replica.name, CLIENT_CLOSED)
                    raise
                held.served = upstream.status < 400  # an error answer (404...) served no prompt
                completed = await self._relay(turn, replica, lease, upstream)
            if completed:
                self._turn_done(turn, replica)
            return

    async def _admit(self, turn: Turn, replica: Replica) -> tuple[Replica, TurnLease | AdmissionError]:
        """The gate's lease on `replica`, or its refusal, with the replica it is for: a held
        turn may move once to another routable replica with nothing to do
        (`SessionRelocated`), and is acquired there instead. A client that leaves while the
        turn waits cancels the wait (counted, then re-raised)."""
        if turn.route.kind == PASSTHROUGH:
            return replica, UNGATED  # not a turn: nothing for the gate to price or hold
        acquire, kind, held_on = self.admission.acquire, turn.route.kind, replica
        size = None if turn.raw is None else len(turn.raw)  # the body's bytes, as forwarded
        try:
            try:
                elsewhere = lambda: others(self.registry.routable(), held_on)  # noqa: E731 (read only if held)
                return replica, await acquire(
                    replica, turn.session_id, kind, turn.body, elsewhere=elsewhere, body_size=size
                )
            except SessionRelocated as moved:  # the session sticks where the turn is served (`_relay`)
                replica = moved_to(self.registry.routable(), moved.replica, replica)
                turn.replica = replica.name
                return replica, await acquire(replica, turn.session_id, kind, turn.body, body_size=size)
        except asyncio.CancelledError:
            self.metrics.upstream_errors.labels(replica.name, "client_disconnect").inc()
            self._count(turn.route.kind, replica.name, CLIENT_CLOSED)
            raise
        except AdmissionError as refusal:
            return replica, refusal

    def _refuse(self, turn: Turn, replica: Replica, refusal: AdmissionError) -> None:
        self._count(turn.route.kind, replica.name, refusal.status)
        send_error(
            turn.responder,
            refusal.status,
            refusal.message,
            refusal.code,
            [(H_REPLICA, replica.name.encode()), *retry_after(refusal.retry_after)],
            type_=refusal.error_type,
        )

    def _after_connect_failure(
        self, turn: Turn, replica: Replica, lease: TurnLease, spent: frozenset[Failure], error: Exception
    ) -> Replica | None:
        """No connection to `replica` could be opened: the replica to re-send the turn to, or
        None once the client has its 502."""
        then = after_failure(Failure.CONNECT, spent, self._tiered, replica.in_flight)
        if then.mark_failed:
            self.registry.mark_failed(replica)
        self.metrics.upstream_errors.labels(replica.name, "connect").inc()
        if then.resend is Resend.SAME:
            return replica
        resend = self._choose(turn.session_id, exclude=replica) if then.resend is Resend.OTHER else None
        if resend is None:
            self._count(turn.route.kind, replica.name, 502)
            send_error(
                turn.responder,
                502,
                f"could not connect to replica {replica.name} ({error}); it is marked "
                "unhealthy until its health checks pass (unless it has requests in flight); retry later",
                "upstream_connect_failed",
                lease_headers(replica, lease),
            )
        return resend

    async def _relay(self, turn: Turn, replica: Replica, lease: TurnLease, upstream: UpstreamResponse) -> bool:
        """Relay the replica's answer; True when it was relayed whole with a status under 400."""
        if replica.health.fail_streak:
            self.registry.record_answer(replica)
        if turn.entry is not None:
            turn.entry.replica = replica  # stick: the session's next turn goes here while it can
        status = CLIENT_CLOSED
        completed = False
        kind = turn.route.kind
        tap = None
        if self._learns_usage and kind in USAGE_KINDS:
            # a named session's reply may end its agent's run only where the model chose (proxy.reply_end)
            read_end = self._ends_runs and turn.session_id is not None and leaves_tools_to_model(turn.body)
            tap = UsageTap(turn.strip_usage, kind, read_end)
        try:
            status, completed = await self.relay.relay(turn.responder, upstream, replica, lease, turn.stream, kind, tap)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.upstream_errors.labels(replica.name, "client_disconnect").inc()
            raise
        finally:
            if tap is not None:
                if not completed:
                    tap.finish()  # cut short (the client gone): read the usage off what came
                # The answer's usage came, so the replica served the prompt: the gate learns
                # it even from a client gone before the stream's last bytes (SDKs stop at [DONE]).
                if tap.usage is not None:
                    lease.learn(tap.usage.prompt_tokens, tap.usage.cached_tokens, tap.usage.output_tokens)
                if completed and status < 400 and tap.end is ReplyEnd.FINAL:
                    lease.end_run()  # the agent's run is over: its window goes at once, not after its quiet lifetime
            if not completed:
                upstream.close()  # drop the connection: vLLM sees the disconnect and aborts
            self._count(kind, replica.name, status)
        return completed and status < 400

    def _turn_done(self, turn: Turn, replica: Replica) -> None:
        """A turn answered whole: count it for its session, and link a Responses answer to its replica."""
        entry, chain = turn.entry, turn.chain
        if entry is not None and turn.index and turn.route.kind in PROMPT_KINDS:
            entry.turns = turn.index
            self._observe_turn(turn.index, time.perf_counter() - turn.started)
        if chain is not None and chain.response_id is not None:
            assert chain.chain_session is not None  # TurnPlan: set whenever response_id is
            self.sessions.responses.record(chain.response_id, chain.chain_session, replica, turn.request.tenant)

    # ---- helpers ---------------------------------------------------------------------

    def _log_access(
        self, kind: str, session_id: str | None, turn: Turn | None, status: int, started: float, refused: str = ""
    ) -> None:
        assert self._access is not None
        self._access.info(
            "%s",
            access_line(
                time.time(),
                kind,
                session_id,
                turn.replica if turn is not None else None,
                turn.admission if turn is not None else refused,
                turn.wait_ms if turn is not None else 0.0,
                status,
                time.perf_counter() - started,
            ),
        )

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


def _forwarded_body(turn: Turn, lease: TurnLease) -> bytes | None:
    """The body sent upstream: as received, at the priority the admission asked for
    (`Lease.priority`: a turn the gate would hold, forwarded to yield to window holders),
    with the KV pin it gave (`Lease.pin`: the session's window, kept in the engine)."""
    raw = turn.raw
    if raw is None:
        return None
    if lease.priority is not None:
        raw = with_priority(raw, turn.body, lease.priority)
    pin = getattr(lease, "pin", None)  # a lease of another admission may predate pins
    if pin is not None:
        raw = with_kv_pin(raw, turn.body, pin)
    return raw
