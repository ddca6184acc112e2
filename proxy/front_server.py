"""The front server: listens, holds at most limits.max_connections client connections, and
enforces the connections' timeouts.

Invariants:
- At the limit, a new connection displaces the one that has waited longest without a
  request past the screen (idle, mid-head, closing after a refusal); with none to
  displace, it is answered 503 and closed (`_Refused`).
- The limit is lowered to what the descriptor limit can hold with one upstream
  connection per client connection and RESERVED_FDS kept for health checks and probes.
- One sweeper task expires connections a few times per shortest timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import resource
import time

from kvgate.proxy.http_server import LINGER_SEC, FrontProtocol, Handler, Screen, _let_in, response_head
from kvgate.proxy.settings import LimitsSettings

log = logging.getLogger("kvgate.http")

# Descriptors kept free beyond one upstream connection per client connection:
# health checks, probes, listening sockets, log files.
RESERVED_FDS = 64


def too_many_connections_response(limit: int) -> bytes:
    from kvgate.proxy.errors import error_json

    body = error_json(
        503,
        f"kvgate serves at most limits.max_connections ({limit}) client connections; retry later",
        "too_many_connections",
    )
    return b"".join(
        response_head(503, [(b"Content-Type", b"application/json"), (b"Retry-After", b"1")])
        + [b"Content-Length: ", str(len(body)).encode(), b"\r\nConnection: close\r\n\r\n", body]
    )


MAX_LINGERING_REFUSALS = 64
# Displaceable connections looked at, oldest first, for one to displace at the limit: a
# bounded cost per accepted connection, however many are open.
EVICTION_SCAN = 64


class _Refused(asyncio.Protocol):
    """A connection beyond limits.max_connections: answered 503 and closed.

    The close lingers (so that a client still sending its request reads the 503
    rather than a reset) for at most MAX_LINGERING_REFUSALS connections at a time;
    beyond that, refused connections close at once, so that a flood of them cannot
    take the descriptors kept for upstream connections and health checks."""

    def __init__(self, answer: bytes, server: FrontServer) -> None:
        self._answer = answer
        self._server = server
        self._lingering = False

    def connection_made(self, transport) -> None:
        transport.write(self._answer)
        if transport.can_write_eof() and self._server.lingering_refusals < MAX_LINGERING_REFUSALS:
            self._lingering = True
            self._server.lingering_refusals += 1
            transport.write_eof()
            asyncio.get_event_loop().call_later(LINGER_SEC, transport.close)
        else:
            transport.close()

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc) -> None:
        if self._lingering:
            self._server.lingering_refusals -= 1


def connection_limit(configured: int, upstream_per_client: int = 1, reserved: int = RESERVED_FDS) -> int:
    """The client connections this process can hold: `configured`, lowered when the
    descriptor limit (raised to its hard limit first) cannot also hold one upstream
    connection per client connection plus `reserved` for health checks and probes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = configured * (1 + upstream_per_client) + reserved
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return configured
    fitted = max(1, (soft - reserved) // (1 + upstream_per_client))
    log.warning("limits.max_connections %d lowered to %d: the descriptor limit is %d", configured, fitted, soft)
    return fitted


class FrontServer:
    """Listens and hands every request to `handler`; `close()` stops and drops connections."""

    def __init__(self, handler: Handler, limits: LimitsSettings | int, screen: Screen = _let_in) -> None:
        self._handler = handler
        self._screen = screen
        self._limits = limits if isinstance(limits, LimitsSettings) else LimitsSettings(max_body_bytes=limits)
        self._server: asyncio.base_events.Server | None = None
        self.connections: set[FrontProtocol] = set()
        # Connections holding no screened request (idle, mid-head, closing after a refusal),
        # longest in that state first: an ordered set, the candidates to displace.
        self._displaceable: dict[FrontProtocol, None] = {}
        self._max_connections = self._limits.max_connections
        self._refusal = b""
        self.lingering_refusals = 0
        self._sweeper: asyncio.Task | None = None

    def _protocol(self) -> asyncio.Protocol:
        if len(self.connections) >= self._max_connections and not self._evict_one():
            return _Refused(self._refusal, self)
        return FrontProtocol(self._handler, self._limits, self, self._screen)

    def _evict_one(self) -> bool:
        """Make room at the limit: close the connection that has waited longest without a
        request past the screen (a slow or idle socket), if there is one. Every slot is
        then either a request being served, a body being read (screened: authenticated
        where keys are set) or a socket that the next client may displace, so anonymous
        sockets cannot keep /health and keyed clients out."""
        for conn in itertools.islice(self._displaceable, EVICTION_SCAN):
            if conn.evictable:  # not if a pipelined head began while a request is answered
                del self._displaceable[conn]
                self.connections.discard(conn)
                conn.evict()
                return True
        return False

    def displaceable(self, conn: FrontProtocol, holds_nothing: bool) -> None:
        """Record whether `conn` holds no screened request; one that newly holds none goes last."""
        self._displaceable.pop(conn, None)
        if holds_nothing:
            self._displaceable[conn] = None

    async def start(self, host: str, port: int, backlog: int = 2048) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._max_connections = connection_limit(self._limits.max_connections)
        self._refusal = too_many_connections_response(self._max_connections)
        self._server = await loop.create_server(self._protocol, host, port, backlog=backlog, reuse_address=True)
        self._sweeper = loop.create_task(self._sweep())
        address = self._server.sockets[0].getsockname()
        return address[0], address[1]

    async def _sweep(self) -> None:
        """Enforce the timeouts: one pass over the connections, a few times per shortest timeout."""
        limits = self._limits
        shortest = min(
            limits.header_timeout_sec, limits.body_timeout_sec, limits.keepalive_timeout_sec, limits.write_timeout_sec
        )
        interval = min(1.0, max(0.02, shortest / 4))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.expire(now)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):  # added by connection_made: each has its transport
                conn._transport.close()
            await self._server.wait_closed()
            self._server = None
