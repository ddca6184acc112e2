"""The admin API (SPEC.md section 5): sessions, replicas, state.

Mounted only when `admin.token` is set; every call needs `Authorization: Bearer
<token>` (401 otherwise, compared in constant time).
"""

from __future__ import annotations

import hmac

import orjson
from aiohttp import web

from balancer.registry import RegistryError
from proxy.errors import RequestRejected, error_response
from proxy.request_body import parse_json_object
from proxy.session_id import bounded_session_id


def _json(data, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


class AdminApi:
    def __init__(self, token: str, registry, admission, clients, sessions) -> None:
        self._expected = f"Bearer {token}".encode()
        self.registry = registry
        self.admission = admission
        self.clients = clients
        self.sessions = sessions

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/admin/sessions/{session_id}/finish", self._guard(self.finish_session))
        app.router.add_get("/admin/state", self._guard(self.state))
        app.router.add_post("/admin/replicas", self._guard(self.add_replica))
        app.router.add_delete("/admin/replicas/{name}", self._guard(self.remove_replica))
        app.router.add_post("/admin/replicas/{name}/drain", self._guard(self.drain_replica))

    def _guard(self, handler):
        async def guarded(request: web.Request) -> web.StreamResponse:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):
                return error_response(401, "admin API needs 'Authorization: Bearer <admin.token>'",
                                      "unauthorized", headers={"WWW-Authenticate": "Bearer"})
            return await handler(request)
        return guarded

    async def finish_session(self, request: web.Request) -> web.Response:
        session_id = bounded_session_id(request.match_info["session_id"])
        self.admission.finish_session(session_id)
        self.sessions.forget(session_id)
        return _json({"finished": True})

    async def state(self, request: web.Request) -> web.Response:
        return _json({"replicas": [r.describe() for r in self.registry.all()],
                      "tracked_sessions": len(self.sessions),
                      "gates": self.admission.state()})

    async def add_replica(self, request: web.Request) -> web.Response:
        try:
            body = parse_json_object(await request.read())
        except RequestRejected as exc:
            return error_response(exc.status, exc.message, exc.code)
        name, url, weight = body.get("name"), body.get("url"), body.get("weight", 1)
        if not isinstance(name, str) or not isinstance(url, str):
            return error_response(400, "send {\"name\": str, \"url\": str, \"weight\"?: number}", "invalid_body")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            return error_response(400, "field 'weight' must be a number > 0", "invalid_type")
        try:
            replica = self.registry.add(name, url, weight)
        except RegistryError as exc:
            return error_response(409 if "already exists" in str(exc) else 400, str(exc), "invalid_replica")
        return _json(replica.describe(), status=201)

    async def remove_replica(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            replica = self.registry.remove(name)
        except RegistryError as exc:
            return error_response(404, str(exc), "unknown_replica")
        self.admission.remove_replica(name)
        self.sessions.forget_replica(replica)
        self.clients.retire(replica)
        return _json({"removed": name})

    async def drain_replica(self, request: web.Request) -> web.Response:
        try:
            replica = self.registry.drain(request.match_info["name"])
        except RegistryError as exc:
            return error_response(404, str(exc), "unknown_replica")
        return _json(replica.describe())
