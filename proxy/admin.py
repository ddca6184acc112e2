"""The admin API (docs/reference.md, Admin API): sessions, replicas, state, status.

Served only when `admin.token` is set; every call needs `Authorization: Bearer
<token>` (401 otherwise, compared in constant time), but the status page's own files
(`GET /admin/ui`, proxy/status_page.py), which hold no data: the page sends the token on
every call it makes.
"""

from __future__ import annotations

import hmac

import orjson

from kvgate.balancer.registry import RegistryError
from kvgate.proxy.client_auth import gets_credentials
from kvgate.proxy.errors import JSON_CONTENT_TYPE, RequestRejected, send_error
from kvgate.proxy.http_fields import decode_path_segment
from kvgate.proxy.http_server import HeadRefusal, HttpRequest, Responder
from kvgate.proxy.request_body import parse_json_object
from kvgate.proxy.session_id import bounded_session_id
from kvgate.proxy.status_page import StatusPage


def _json(responder: Responder, data, status: int = 200) -> None:
    responder.send(status, orjson.dumps(data), [JSON_CONTENT_TYPE])


class AdminApi:
    def __init__(
        self,
        token: str,
        registry,
        admission,
        clients,
        sessions,
        credential_hosts: tuple[str, ...] = (),
        status: StatusPage | None = None,
    ) -> None:
        self._expected = f"Bearer {token}".encode()
        self._credential_hosts = credential_hosts  # upstream.credential_hosts (proxy/client_auth.py)
        self.registry = registry
        self.admission = admission
        self.clients = clients
        self.sessions = sessions
        self.status = status  # the status page (GET /admin/ui, /admin/status); None: not served

    def is_public(self, path: str) -> bool:
        """Whether `path` is served without the token: the status page's files."""
        return self.status is not None and self.status.is_asset(path)

    def allows(self, headers) -> bool:
        """Whether `headers` carry `Authorization: Bearer <admin.token>` (constant time)."""
        given = headers.get("authorization", "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, self._expected)

    @staticmethod
    def refusal() -> HeadRefusal:
        return HeadRefusal(
            401,
            "admin API needs 'Authorization: Bearer <admin.token>'",
            "unauthorized",
            ((b"WWW-Authenticate", b"Bearer"),),
        )

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        """Answer a request whose path starts with /admin/ (its token was checked at its head,
        `allows`; checked again here for callers without the server's screen)."""
        if self.status is not None and self.status.is_asset(request.path):
            self.status.send_asset(request, responder)
            return
        if not self.allows(request.headers):
            refusal = self.refusal()
            send_error(responder, refusal.status, refusal.message, refusal.code, list(refusal.headers))
            return
        try:
            self._route(request, responder)
        except RequestRejected as exc:  # a path segment or id that is not UTF-8 text
            send_error(responder, exc.status, exc.message, exc.code)

    def _route(self, request: HttpRequest, responder: Responder) -> None:
        parts = request.path.split("/")[2:]  # after "", "admin"
        method = request.method
        if parts == ["state"] and method == "GET":
            self.state(responder)
        elif parts == ["status"] and method == "GET" and self.status is not None:
            self.status.send_status(request, responder)
        elif parts == ["status", "history"] and method == "GET" and self.status is not None:
            self.status.send_history(responder)
        elif parts == ["replicas"] and method == "POST":
            self.add_replica(request, responder)
        elif len(parts) == 2 and parts[0] == "replicas" and parts[1] and method == "DELETE":
            self.remove_replica(decode_path_segment(parts[1], "replica name"), responder)
        elif len(parts) == 3 and parts[0] == "replicas" and parts[2] == "drain" and method == "POST":
            self.drain_replica(decode_path_segment(parts[1], "replica name"), responder)
        elif len(parts) == 3 and parts[0] == "sessions" and parts[1] and parts[2] == "finish" and method == "POST":
            self.finish_session(decode_path_segment(parts[1]), responder)
        else:
            send_error(
                responder, 404, f"unknown admin route {method} {request.path}; see docs/reference.md", "unknown_route"
            )

    def finish_session(self, raw_id: str, responder: Responder) -> None:
        session_id = bounded_session_id(raw_id)
        self.admission.finish_session(session_id)
        self.sessions.forget(session_id)
        _json(responder, {"finished": True})

    def state(self, responder: Responder) -> None:
        _json(
            responder,
            {
                "replicas": [r.describe() for r in self.registry.all()],
                "tracked_sessions": len(self.sessions),
                "gates": self.admission.state(),
            },
        )

    def add_replica(self, request: HttpRequest, responder: Responder) -> None:
        try:
            body = parse_json_object(request.body)
        except RequestRejected as exc:
            send_error(responder, exc.status, exc.message, exc.code)
            return
        name, url, weight = body.get("name"), body.get("url"), body.get("weight", 1)
        if not isinstance(name, str) or not isinstance(url, str):
            send_error(responder, 400, 'send {"name": str, "url": str, "weight"?: number}', "invalid_body")
            return
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            send_error(responder, 400, "field 'weight' must be a number > 0", "invalid_type")
            return
        try:
            replica = self.registry.add(name, url, weight, gets_credentials(url, self._credential_hosts))
        except RegistryError as exc:
            send_error(responder, 409 if "already exists" in str(exc) else 400, str(exc), "invalid_replica")
            return
        _json(responder, replica.describe(), status=201)

    def remove_replica(self, name: str, responder: Responder) -> None:
        try:
            replica = self.registry.remove(name)
        except RegistryError as exc:
            send_error(responder, 404, str(exc), "unknown_replica")
            return
        self.admission.remove_replica(name)
        self.sessions.forget_replica(replica)
        self.clients.retire(replica)
        _json(responder, {"removed": name})

    def drain_replica(self, name: str, responder: Responder) -> None:
        try:
            replica = self.registry.drain(name)
        except RegistryError as exc:
            send_error(responder, 404, str(exc), "unknown_replica")
            return
        _json(responder, replica.describe())
