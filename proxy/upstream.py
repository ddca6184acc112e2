"""Connections to the replicas and the header rules for relaying through them.

One keep-alive pool (`proxy.http_client.UpstreamPool`) per replica, with no cap on
connections: the gate, not the pool, decides how much work a replica gets.
Bodies are relayed as raw bytes; a compressed body passes through with its
Content-Encoding untouched.
"""

from __future__ import annotations

import asyncio

from kvgate.proxy.http_client import UpstreamConnectError, UpstreamError, UpstreamPool
from kvgate.proxy.settings import UpstreamSettings

# Hop-by-hop headers (RFC 9110 7.6.1): never forwarded in either direction.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# ... and the ones the proxy recomputes on each side.
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"content-length", b"expect"}
_RESPONSE_DROP = _HOP_BY_HOP | {b"content-length", b"date"}

# The request never reached the replica: safe to send it elsewhere.
CONNECT_ERRORS = (UpstreamConnectError,)
# The exchange broke once the connection existed.
EXCHANGE_ERRORS = (UpstreamError, OSError)


def connection_named(headers) -> frozenset[bytes]:
    """The lower-case header names listed in Connection headers (RFC 9110 7.6.1):
    hop-by-hop by declaration, so never relayed."""
    names: frozenset[bytes] = frozenset()
    for name, value in headers:
        if len(name) == 10 and name.lower() == b"connection":
            names |= {token.strip().lower() for token in value.split(b",")}
    return names


def upstream_request_headers(
    raw_headers, api_key: str | None, drop_client_keys: bool = False
) -> list[tuple[bytes, bytes]]:
    """The client's raw headers minus hop-by-hop ones (fixed, and those Connection
    names); `api_key` replaces Authorization. `drop_client_keys` (client authentication
    on): the key the client showed kvgate (Authorization, x-api-key) goes no further."""
    named = connection_named(raw_headers)
    drop = _REQUEST_DROP | named if named else _REQUEST_DROP
    if drop_client_keys:
        drop = drop | {b"authorization", b"x-api-key"}
    elif api_key:
        drop = drop | {b"authorization"}
    out = [(k, v) for k, v in raw_headers if k.lower() not in drop]
    if api_key:
        out.append((b"Authorization", b"Bearer " + api_key.encode()))
    return out


def relayed_response_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream's headers minus hop-by-hop ones (fixed, and those Connection names)
    and those the proxy's server sets."""
    named = connection_named(headers)
    drop = _RESPONSE_DROP | named if named else _RESPONSE_DROP
    return [(k, v) for k, v in headers if k.lower() not in drop]


class UpstreamClients:
    """Owns the connection pool of each replica (keyed by the Replica object)."""

    def __init__(self, settings: UpstreamSettings) -> None:
        self._settings = settings
        self._pools: dict[object, UpstreamPool] = {}
        self._closing: set[asyncio.Task] = set()

    def for_replica(self, replica) -> UpstreamPool:
        pool = self._pools.get(replica)
        if pool is None:
            pool = self._pools[replica] = UpstreamPool(
                replica.url, self._settings.connect_timeout_sec, self._settings.read_timeout_sec
            )
        return pool

    def retire(self, replica) -> None:
        """Close a removed replica's pool once its in-flight requests have ended."""
        pool = self._pools.pop(replica, None)
        if pool is None:
            return
        task = asyncio.ensure_future(self._close_when_idle(replica, pool))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_when_idle(self, replica, pool: UpstreamPool) -> None:
        waited = 0.0
        while replica.in_flight > 0 and waited < self._settings.read_timeout_sec:
            await asyncio.sleep(0.5)
            waited += 0.5
        pool.close()

    async def close(self) -> None:
        for task in list(self._closing):
            task.cancel()
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
