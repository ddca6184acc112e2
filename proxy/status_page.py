"""The status page: `GET /admin/ui` and the JSON it polls (docs/observability.md, The status page).

The page is three static files in `proxy/status-page/` (HTML, JavaScript, CSS; package data, no
build step), served as they are. They hold no data and no secret, so they are served
without the admin token (a browser cannot put a bearer token on a navigation): the
page asks for the token once, keeps it in the tab's sessionStorage and sends it as
`Authorization: Bearer` on every call it makes (`/admin/status`, `/admin/status/history`
and the admin actions), which need it as every admin call does.

`StatusPage` also samples the counters behind the page's chart (hit rate and admissions
by reason) every HISTORY_INTERVAL_SEC into a `CounterHistory`: reading a few counters,
whether or not a page is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from importlib import resources

import orjson
from prometheus_client.registry import Collector

from kvgate.proxy.errors import JSON_CONTENT_TYPE, send_error
from kvgate.proxy.http_server import HttpRequest, Responder
from kvgate.proxy.status_history import HISTORY_INTERVAL_SEC, CounterHistory, ReplicaCounters
from kvgate.proxy.status_snapshot import StatusSources, parse_status_query, status_snapshot

UI_PATH = "/admin/ui"
_ASSETS = {  # path -> (file in proxy/status-page/, content type)
    UI_PATH: ("index.html", b"text/html; charset=utf-8"),
    UI_PATH + "/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    UI_PATH + "/style.css": ("style.css", b"text/css; charset=utf-8"),
}
# The page runs only its own files: no inline script, nothing from elsewhere, never framed
# (another site cannot wrap the page's buttons), no referrer, and the token never cached.
_ASSET_HEADERS = [
    (
        b"Content-Security-Policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        b"frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
    (b"X-Content-Type-Options", b"nosniff"),
    (b"Referrer-Policy", b"no-referrer"),
    (b"Cache-Control", b"no-cache"),
]
_NO_STORE = (b"Cache-Control", b"no-store")


def _load_assets() -> dict[str, tuple[bytes, bytes]]:
    folder = resources.files("kvgate.proxy").joinpath("status-page")
    return {path: (folder.joinpath(name).read_bytes(), kind) for path, (name, kind) in _ASSETS.items()}


class StatusPage:
    """Serves the page's files and its JSON; samples the history while started.

    `sources()` returns the live objects a snapshot reads (proxy.status_snapshot);
    `admissions` is the gate's `kvgate_admissions_total` family.
    """

    def __init__(
        self,
        sources: Callable[[], StatusSources],
        admissions: Collector,
        interval_sec: float = HISTORY_INTERVAL_SEC,
    ) -> None:
        self._sources = sources
        self._admissions = admissions
        self._interval = interval_sec
        self.history = CounterHistory()
        self._assets = _load_assets()
        self._task: asyncio.Task | None = None

    @staticmethod
    def is_asset(path: str) -> bool:
        """Whether `path` is one of the page's files (served without the token)."""
        return path in _ASSETS

    def send_asset(self, request: HttpRequest, responder: Responder) -> None:
        if request.method != "GET":
            send_error(
                responder,
                405,
                f"{request.method} is not allowed on {request.path}; use GET",
                "method_not_allowed",
                [(b"Allow", b"GET")],
            )
            return
        body, kind = self._assets[request.path]
        responder.send(200, body, [(b"Content-Type", kind), *_ASSET_HEADERS])

    def send_status(self, request: HttpRequest, responder: Responder) -> None:
        """`GET /admin/status` (token checked by the admin API, which answers a RequestRejected
        from a bad query as a 400)."""
        body = orjson.dumps(status_snapshot(self._sources(), parse_status_query(request.query)))
        responder.send(200, body, [JSON_CONTENT_TYPE, _NO_STORE])

    def send_history(self, responder: Responder) -> None:
        """`GET /admin/status/history` (token checked by the admin API)."""
        body = orjson.dumps({"interval_sec": self._interval, **self.history.series()})
        responder.send(200, body, [JSON_CONTENT_TYPE, _NO_STORE])

    # ---- the history sampler ----------------------------------------------------------

    def sample(self) -> None:
        """Record every replica's counters now."""
        sources = self._sources()
        by_replica: dict[str, dict[str, float]] = {}
        for metric in self._admissions.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    by_replica.setdefault(s.labels["replica"], {})[s.labels["reason"]] = s.value
        sample = {}
        for replica in sources.replicas:
            mirrored = sources.mirrored(replica.name)
            sample[replica.name] = ReplicaCounters(
                mirrored.get("vllm:prefix_cache_hits_total"),
                mirrored.get("vllm:prefix_cache_queries_total"),
                by_replica.get(replica.name, {}),
            )
        self.history.record(time.time(), sample)

    async def start(self) -> None:
        self.sample()
        self._task = asyncio.create_task(self._loop(), name="kvgate-status-history")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self.sample()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
