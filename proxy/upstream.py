"""HTTP clients to the replicas and the header rules for relaying through them.

One aiohttp ClientSession per replica, with a keep-alive pool and no connection cap
(the gate, not the pool, decides how much work a replica gets). Responses are
relayed as raw bytes: `auto_decompress` is off, so a compressed body passes through
with its Content-Encoding untouched.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from multidict import CIMultiDict

from proxy.settings import UpstreamSettings

log = logging.getLogger("kvgate.proxy")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the client library recomputes.
_REQUEST_DROP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length", "expect",
})
_RESPONSE_DROP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "content-length", "date", "server",
})

# Errors that mean the request never reached the replica: safe to send elsewhere.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Errors of an upstream exchange once the connection exists.
EXCHANGE_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def upstream_request_headers(headers, api_key: str | None) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones; `api_key` replaces Authorization."""
    out = {k: v for k, v in headers.items() if k.lower() not in _REQUEST_DROP}
    if api_key:
        for key in [k for k in out if k.lower() == "authorization"]:
            del out[key]
        out["Authorization"] = f"Bearer {api_key}"
    return out


def relayed_response_headers(headers) -> CIMultiDict:
    """The upstream's headers minus hop-by-hop ones and those the proxy's server sets."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _RESPONSE_DROP)


class UpstreamClients:
    """Owns the ClientSession of each replica (keyed by the Replica object)."""

    def __init__(self, settings: UpstreamSettings) -> None:
        self._settings = settings
        self._sessions: dict[object, aiohttp.ClientSession] = {}
        self._closing: set[asyncio.Task] = set()
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=settings.connect_timeout_sec,
            sock_connect=settings.connect_timeout_sec, sock_read=settings.read_timeout_sec)

    def for_replica(self, replica) -> aiohttp.ClientSession:
        session = self._sessions.get(replica)
        if session is None:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60,
                                               enable_cleanup_closed=False),
                timeout=self.timeout, auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
            self._sessions[replica] = session
        return session

    def retire(self, replica) -> None:
        """Close a removed replica's pool once its in-flight requests have ended."""
        session = self._sessions.pop(replica, None)
        if session is None:
            return
        task = asyncio.ensure_future(self._close_when_idle(replica, session))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_when_idle(self, replica, session: aiohttp.ClientSession) -> None:
        waited = 0.0
        while replica.in_flight > 0 and waited < self._settings.read_timeout_sec:
            await asyncio.sleep(0.5)
            waited += 0.5
        await session.close()

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
