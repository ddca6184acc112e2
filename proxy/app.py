"""The proxy application: routes, own endpoints, admin API, lifecycle.

`create_app` wires the parts; every collaborator with a seam can be injected
(`admission` is Seam 1's AdmissionController; `replicas` overrides
`settings.replicas`, which is how `serve` hands over simulated replicas).
`await app.start(host, port)` listens (port 0: a free port) and starts health
checks; `await app.close()` stops everything it started.
"""

from __future__ import annotations

import asyncio
import inspect
import time

import orjson

from kvgate.balancer import Balancer, ReplicaRegistry
from kvgate.balancer.health import HealthChecker
from kvgate.balancer.replica_metrics import ReplicaMetricsScraper
from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.admission import AdmissionController
from kvgate.gate.gate import MODES
from kvgate.gate.ownership import Ownership, OwnershipClaims, conflict_flag, default_gate_id, gate_mode, readiness
from kvgate.gate.probe import missing_probe_api
from kvgate.proxy.admin import AdminApi
from kvgate.proxy.canonical_path import non_canonical_message, path_problem
from kvgate.proxy.client_auth import OPEN_PATHS, ClientAuth
from kvgate.proxy.errors import JSON_CONTENT_TYPE, RequestRejected, error_shape, send_error
from kvgate.proxy.forward import Forwarder
from kvgate.proxy.front_server import FrontServer
from kvgate.proxy.http_fields import decode_path_segment
from kvgate.proxy.http_server import HeadRefusal, HttpRequest, Responder
from kvgate.proxy.metrics import CONTENT_TYPE, KvgateMetrics
from kvgate.proxy.session_tracker import SessionTracker
from kvgate.proxy.settings import Settings
from kvgate.proxy.status_page import StatusPage
from kvgate.proxy.status_snapshot import StatusSources
from kvgate.proxy.topology import FRONT_DOOR, REPLICA_GATE, claims_ownership, health_path
from kvgate.proxy.upstream import UpstreamClients
from kvgate.wire.replica_auth import replica_headers
from kvgate.wire.routes import ROUTES, passthrough_route

_JSON_OK = orjson.dumps({"status": "ok"})
_METRICS_TYPE = (b"Content-Type", CONTENT_TYPE.encode())
_GATING_MODES = frozenset(MODES) - {"off"}
_ROUTE_LIST = (
    ", ".join(f"{r.method} {r.path}" for r in ROUTES)
    + ", any other /v1/ route to the session's replica (also under /sess/{session_id}/)"
)


class ProxyApp:
    def __init__(self, settings: Settings, metrics: KvgateMetrics, admission, replicas, health_checks: bool) -> None:
        self.settings = settings
        self.metrics = metrics
        self.admission = admission
        self.registry = ReplicaRegistry(settings.balancer.health, metrics.balancer)
        for r in replicas:
            self.registry.add(r.name, r.url, r.weight)
        self.balancer = Balancer(self.registry, settings.balancer)
        self.clients = UpstreamClients(settings.upstream)
        self.auth = ClientAuth(settings.auth.api_keys)
        self.sessions = SessionTracker()
        self.forwarder = Forwarder(settings, self.balancer, admission, self.clients, metrics, self.sessions)
        self.health = HealthChecker(
            self.registry,
            settings.balancer.health,
            health_path(settings.role),
            busy_is_alive=settings.role in (FRONT_DOOR, REPLICA_GATE),
            # a front door's replica gates may ask for a client key on /ready (auth.api_keys)
            headers=replica_headers(settings.upstream.api_key, None) if settings.role == FRONT_DOOR else None,
        )
        self.ownership = (
            OwnershipClaims(
                settings.ownership.gate_id or default_gate_id(),
                settings.ownership.ttl_sec,
                self._replica_urls,
                self._apply_ownership,
                timeout_sec=settings.gate.probe.timeout_sec,
                api_key=settings.upstream.api_key,
                replica_api_key=settings.upstream.replica_api_key,
            )
            if claims_ownership(settings)
            else None
        )
        self._health_checks = health_checks
        # The replicas' own prefix-cache counters, mirrored into /metrics (docs/observability.md).
        self.replica_metrics = ReplicaMetricsScraper(
            self.registry, metrics.gate.probe_seconds, metrics.gate.probe_errors
        )
        metrics.registry.register(self.replica_metrics)
        if settings.role != FRONT_DOOR:  # a front door's replicas are kvgates: nothing of vLLM's to mirror
            self.health.add_round(self.replica_metrics.read_all)
        # A gating kvgate asks each replica for the probe API as soon as it answers, so a vLLM
        # without the plugin is named in the log, /ready and kvgate_replica_probe_api before any turn.
        self._asks_probe_api = _gates_vllm(settings) and hasattr(admission, "learn_probe_api")
        if self._asks_probe_api:
            self.health.add_round(self._learn_probe_apis)
        self.status_page, self.admin = self._admin_api(settings, metrics)
        self._routes = {r.path: r for r in ROUTES}
        self._server: FrontServer | None = None

    def _admin_api(self, settings: Settings, metrics: KvgateMetrics) -> tuple[StatusPage | None, AdminApi | None]:
        """The admin API and its status page (GET /admin/ui), both only with admin.token set."""
        if not settings.admin.token:
            return None, None
        page = StatusPage(self._status_sources, metrics.gate.admissions)
        api = AdminApi(
            settings.admin.token,
            self.registry,
            self.admission,
            self.clients,
            self.sessions,
            settings.upstream.credential_hosts,
            page,
        )
        return page, api

    # ---- lifecycle ---------------------------------------------------------------

    async def start(self, host: str | None = None, port: int | None = None) -> tuple[str, int]:
        """Listen (defaults: settings.listen) and start health checks; the bound address."""
        self._server = FrontServer(self.handle, self.settings.limits, self.screen)
        address = await self._server.start(
            self.settings.listen.host if host is None else host, self.settings.listen.port if port is None else port
        )
        if self._health_checks:
            await self.health.start()
        if self.ownership is not None:
            await self.ownership.start()
        if self.status_page is not None:
            await self.status_page.start()
        return address

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None
        if self.status_page is not None:
            await self.status_page.close()
        await self.health.close()
        if self.ownership is not None:
            await self.ownership.close()
        await self.clients.close()
        close = getattr(self.admission, "aclose", None) or getattr(self.admission, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result

    # ---- ownership (gate/ownership.py) ---------------------------------------------

    def _replica_urls(self) -> list[tuple[str, str]]:
        """The replicas this gate claims: those it may show its credentials to (a replica added at
        run time from an untrusted host is gated, but never sent the replica API key)."""
        return [(r.name, r.url) for r in self.registry.all() if r.credentials]

    def _apply_ownership(self, name: str, ownership: Ownership) -> None:
        """A claim changed this gate's standing on `name`: its gate's mode and the conflict gauge."""
        set_mode = getattr(self.admission, "set_replica_mode", None)
        if set_mode is not None:
            set_mode(name, gate_mode(self.settings.gate.mode, ownership))
        self.metrics.gate.gate_conflict.labels(name).set(conflict_flag(ownership))

    async def _learn_probe_apis(self, _session) -> None:
        """A health round: ask the replicas whose probe API is still unknown (see __init__)."""
        unknown = [r for r in self.registry.all() if self.admission.probe_api(r.name) is None]
        if unknown:
            await asyncio.gather(*(self.admission.learn_probe_api(r) for r in unknown), return_exceptions=True)

    def _missing_probe_apis(self) -> dict[str, str]:
        """Replica name -> what its missing probe API costs and the fix (empty: none missing)."""
        if not self._asks_probe_api:
            return {}
        return {
            r.name: missing_probe_api(r.name, r.url)
            for r in self.registry.all()
            if self.admission.probe_api(r.name) is False
        }

    def _status_sources(self) -> StatusSources:
        """What the status page reads now (proxy/status_snapshot.py)."""
        gates = getattr(self.admission, "gates", None)  # an injected admission may not have gates
        assert self.status_page is not None
        return StatusSources(
            role=self.settings.role,
            replicas=self.registry.all(),
            gates=gates() if gates is not None else {},
            ownership=self.ownership.ownership() if self.ownership is not None else {},
            mirrored=self.replica_metrics.values,
            recent_hit_rate=self.status_page.history.recent_hit_rate,
            tracked_sessions=len(self.sessions),
            now=time.time(),
        )

    def _ready(self, responder: Responder) -> None:
        ownership = self.ownership.ownership() if self.ownership is not None else {}
        ready, conflicts = readiness({r.name: r.healthy for r in self.registry.all()}, ownership)
        if ready:
            # Ready either way: without the plugin the gate still routes and gates on /metrics
            # (degraded); the body names such replicas so a probe's log shows them.
            missing = self._missing_probe_apis()
            body: dict[str, object] = {"status": "ok"}
            if conflicts:
                body["gate_conflicts"] = conflicts
            if missing:
                body["probe_api_missing"] = missing
            responder.send(200, orjson.dumps(body) if len(body) > 1 else _JSON_OK, [JSON_CONTENT_TYPE])
        elif conflicts and self.registry.any_healthy():
            send_error(
                responder,
                503,
                "every healthy replica is gated by another kvgate ("
                + ", ".join(f"{n}: {owner}" for n, owner in sorted(conflicts.items()))
                + "); this one only shadows them: see kvgate_gate_conflict and docs/ARCHITECTURE.md",
                "gate_conflict",
            )
        else:
            send_error(responder, 503, "no healthy replica; see GET /admin/state", "no_healthy_replica")

    # ---- dispatch ----------------------------------------------------------------

    def screen(self, request: HttpRequest, has_body: bool) -> HeadRefusal | None:
        """A request's head, before its body is read (`Screen` in proxy/http_server.py): a canonical
        path (before auth and routing, which must see what the replica sees), then the client
        key, or the admin token on /admin/. Without a key only /health is served, and no
        body is read: an anonymous socket holds nothing but its head."""
        path = request.path
        problem = path_problem(path)
        if problem is not None:
            return HeadRefusal(400, non_canonical_message(path, problem), "non_canonical_path")
        if self._is_admin(path):
            assert self.admin is not None
            return None if self.admin.allows(request.headers) or self.admin.is_public(path) else self.admin.refusal()
        if not self.auth.enabled or (path in OPEN_PATHS and not has_body):
            return None
        index = self.auth.match(request.headers)
        if index >= 0:
            request.tenant = self.auth.tenant(index)
            return None
        return HeadRefusal(
            401,
            "this kvgate needs a client key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') "
            "with one of its auth.api_keys",
            "invalid_api_key",
            ((b"WWW-Authenticate", b"Bearer"),),
        )

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        """Answer a request that passed `screen` (the server screens every head)."""
        path = request.path
        responder.error_shape = error_shape(path)  # kvgate's own errors speak the client's API
        route = self._routes.get(path)
        if route is not None:
            if request.method == route.method:
                await self.forwarder.forward(request, responder, route, None)
            else:
                self._wrong_method(request, responder, route)
            return
        if path.startswith("/sess/"):
            raw_id, slash, rest = path[6:].partition("/")
            route = (self._routes.get("/" + rest) or passthrough_route(request.method, "/" + rest)) if slash else None
            if route is not None:
                if request.method == route.method:
                    try:
                        session_id = decode_path_segment(raw_id)
                    except RequestRejected as exc:
                        send_error(responder, exc.status, exc.message, exc.code)
                        return
                    await self.forwarder.forward(request, responder, route, session_id)
                else:
                    self._wrong_method(request, responder, route)
                return
        elif path == "/health" and request.method == "GET":
            responder.send(200, _JSON_OK, [JSON_CONTENT_TYPE])
            return
        elif path == "/ready" and request.method == "GET":
            self._ready(responder)
            return
        elif path == "/metrics" and request.method == "GET":
            responder.send(200, self.metrics.render(), [_METRICS_TYPE])
            return
        elif path.startswith("/admin/"):
            if self.admin is not None:
                await self.admin.handle(request, responder)
            else:
                send_error(
                    responder,
                    404,
                    f"the admin API is off, so {request.method} {path} is not served; set admin.token "
                    "(KVGATE_ADMIN__TOKEN) to enable it, then send 'Authorization: Bearer <token>'",
                    "admin_api_disabled",
                )
            return
        else:
            route = passthrough_route(request.method, path)
            if route is not None:  # another route vLLM serves: to the session's replica, ungated
                await self.forwarder.forward(request, responder, route, None)
                return
        send_error(
            responder, 404, f"unknown route {request.method} {path}; kvgate forwards {_ROUTE_LIST}", "unknown_route"
        )

    def _is_admin(self, path: str) -> bool:
        """/admin/* authenticates with admin.token instead of a client key (proxy/admin.py)."""
        return self.admin is not None and path.startswith("/admin/")

    def _wrong_method(self, request: HttpRequest, responder: Responder, route) -> None:
        send_error(
            responder,
            405,
            f"{request.method} is not allowed on {request.path}; use {route.method}",
            "method_not_allowed",
            [(b"Allow", route.method.encode())],
        )


def _gates_vllm(settings: Settings) -> bool:
    """Whether this kvgate gates vLLM servers itself (and so reads their probe API)."""
    return settings.role != FRONT_DOOR and settings.gate.mode in _GATING_MODES


def create_app(
    settings: Settings | None = None,
    *,
    metrics: KvgateMetrics | None = None,
    admission=None,
    replicas: list[ReplicaSettings] | tuple[ReplicaSettings, ...] | None = None,
    health_checks: bool = True,
) -> ProxyApp:
    """The proxy app. `health_checks=False` leaves health to passive marking (tests)."""
    settings = settings or Settings()
    metrics = metrics or KvgateMetrics()
    if admission is None:
        admission = AdmissionController(
            settings.gate,
            metrics.gate,
            api_key=settings.upstream.api_key,
            replica_api_key=settings.upstream.replica_api_key,
        )
    return ProxyApp(settings, metrics, admission, settings.replicas if replicas is None else replicas, health_checks)
