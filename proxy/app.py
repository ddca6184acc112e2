"""The aiohttp application: forwarded routes, own routes, admin API, lifecycle.

`create_app` wires the parts; every collaborator with a seam can be injected
(`admission` is Seam 1's AdmissionController; `replicas` overrides
`settings.replicas`, which is how `serve` hands over simulated replicas).
"""

from __future__ import annotations

import inspect

import orjson
from aiohttp import web

from balancer import Balancer, ReplicaRegistry
from balancer.health import HealthChecker
from proxy.admin import AdminApi
from proxy.errors import error_response
from proxy.forward import Forwarder
from proxy.metrics import CONTENT_TYPE, KvgateMetrics
from proxy.open_admission import OpenAdmission
from proxy.routes import ROUTES, SESSION_PREFIX
from proxy.session_tracker import SessionTracker
from proxy.settings import ReplicaSettings, Settings
from proxy.upstream import UpstreamClients

REGISTRY = web.AppKey("kvgate_registry", ReplicaRegistry)
BALANCER = web.AppKey("kvgate_balancer", Balancer)
METRICS = web.AppKey("kvgate_metrics", KvgateMetrics)
FORWARDER = web.AppKey("kvgate_forwarder", Forwarder)
HEALTH = web.AppKey("kvgate_health", HealthChecker)
ADMISSION = web.AppKey("kvgate_admission", object)
SESSIONS = web.AppKey("kvgate_sessions", SessionTracker)

_JSON_OK = orjson.dumps({"status": "ok"})


def create_app(settings: Settings | None = None, *, metrics: KvgateMetrics | None = None, admission=None,
               replicas: list[ReplicaSettings] | tuple[ReplicaSettings, ...] | None = None,
               health_checks: bool = True) -> web.Application:
    """The proxy app. `health_checks=False` leaves health to passive marking (tests)."""
    settings = settings or Settings()
    metrics = metrics or KvgateMetrics()
    admission = admission if admission is not None else OpenAdmission(metrics)
    registry = ReplicaRegistry(settings.balancer.health, metrics)
    for r in (settings.replicas if replicas is None else replicas):
        registry.add(r.name, r.url, r.weight)
    balancer = Balancer(registry, settings.balancer)
    clients = UpstreamClients(settings.upstream)
    sessions = SessionTracker()
    forwarder = Forwarder(settings, balancer, admission, clients, metrics, sessions)
    health = HealthChecker(registry, settings.balancer.health)

    app = web.Application(client_max_size=settings.limits.max_body_bytes)
    app[REGISTRY] = registry
    app[BALANCER] = balancer
    app[METRICS] = metrics
    app[FORWARDER] = forwarder
    app[HEALTH] = health
    app[ADMISSION] = admission
    app[SESSIONS] = sessions

    for route in ROUTES:
        handler = forwarder.handler_for(route)
        app.router.add_route(route.method, route.path, handler)
        app.router.add_route(route.method, SESSION_PREFIX + route.path, handler)

    async def health_route(request: web.Request) -> web.Response:
        return web.Response(body=_JSON_OK, content_type="application/json")

    async def ready_route(request: web.Request) -> web.Response:
        if registry.any_healthy():
            return web.Response(body=_JSON_OK, content_type="application/json")
        return error_response(503, "no healthy replica; see GET /admin/state", "no_healthy_replica")

    async def metrics_route(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/health", health_route)
    app.router.add_get("/ready", ready_route)
    app.router.add_get("/metrics", metrics_route)
    if settings.admin.token:
        AdminApi(settings.admin.token, registry, admission, clients, sessions).add_routes(app)

    known = {}
    for route in ROUTES:
        known.setdefault(route.path, []).append(route.method)

    async def unknown_route(request: web.Request) -> web.Response:
        path = request.path
        if path.startswith("/sess/"):
            _, _, rest = path[len("/sess/"):].partition("/")
            path = "/" + rest
        if path in known:
            return error_response(405, f"{request.method} is not allowed on {request.path}; use "
                                  f"{', '.join(known[path])}", "method_not_allowed")
        return error_response(404, f"unknown route {request.method} {request.path}; kvgate forwards "
                              + ", ".join(f"{r.method} {r.path}" for r in ROUTES)
                              + " (also under /sess/{session_id}/)", "unknown_route")

    app.router.add_route("*", "/{tail:.*}", unknown_route)

    async def on_startup(app: web.Application) -> None:
        if health_checks:
            await health.start()

    async def on_cleanup(app: web.Application) -> None:
        await health.close()
        await clients.close()
        close = getattr(admission, "close", None) or getattr(admission, "aclose", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
