"""A minimal HTTP/1.1 client for the relay path: keep-alive pool, raw bytes, no magic.

Why not aiohttp's client: on this path it spends more CPU per request than the whole
rest of the proxy (URL objects, cookie jars, tracing hooks, header multidicts,
timers per request). The relay needs much less: write one request, read the response
with llhttp (httptools), the body whole or piece by piece as it arrives. Bodies
pass through untouched (no decompression, no decoding); chunked framing is removed,
as the proxy's server side re-frames what it writes.

Invariants:
- A connection carries one exchange at a time; it returns to the pool only after a
  complete response that allows keep-alive and nothing after it, otherwise it is
  closed. A malformed response fails the exchange (UpstreamError) and its connection.
- `UpstreamResponse.close()` drops the connection at once (an upstream generation
  whose client left is aborted by vLLM when its connection closes).
- Idle pooled connections are dropped after IDLE_SEC, below uvicorn's 5 s keep-alive,
  so the pool rarely races a server closing an idle connection; when a request on a
  reused connection fails before any response byte, it is retried once on a fresh
  connection (the server closed it idle and never saw the request).
- Reads pause the socket above HIGH_WATER buffered bytes (a slow client slows the
  upstream instead of growing memory).
"""

from __future__ import annotations

import asyncio
import re
import ssl as ssl_module
import time
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

IDLE_SEC = 4.0
HIGH_WATER = 256 * 1024
MAX_HEAD_BYTES = 64 * 1024
_REASON_PHRASE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")  # RFC 9112 4

_HEAD, _BODY, _UNTIL_CLOSE, _DONE = range(4)


class UpstreamError(Exception):
    """The exchange failed after the connection existed; `kind` names where."""

    def __init__(self, message: str, kind: str = "exchange") -> None:
        super().__init__(message)
        self.kind = kind


class UpstreamConnectError(UpstreamError):
    """The connection could not be opened: the request never reached the upstream."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "connect")


class UpstreamTimeout(UpstreamError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "timeout")


class _BadResponse(Exception):
    """Raised from a parser callback: the upstream's response is malformed."""


class _Connection(asyncio.Protocol):
    """One TCP connection to the upstream and the state of its current response.

    Parsed by llhttp (strict mode), plus what llhttp accepts and a proxy must not
    relay: a status outside 100-599, a Transfer-Encoding other than `chunked`, a
    second response head nobody asked for. Any of these (and anything llhttp rejects:
    bad or duplicate Content-Length, bad chunk, bad header bytes) fails the exchange
    and closes the connection. Bytes after a complete response, or arriving while the
    connection idles in the pool, mean the stream is out of step with the requests:
    the connection is closed, never reused.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float) -> None:
        self._loop = loop
        self._read_timeout = read_timeout
        # Set by connection_made, which asyncio runs before create_connection returns this
        # protocol: every connection the pool holds has its transport.
        self.transport: asyncio.Transport
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self.idle = False
        self._parser = httptools.HttpResponseParser(self)  # llhttp starts afresh after each message
        self._reset()

    def _reset(self) -> None:
        self._state = _HEAD
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._error: UpstreamError | None = None
        self._head_bytes = 0
        self._length: int | None = None
        self._chunked = False
        self.got_bytes = False
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True

    # ---- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport (uvloop's has asyncio.Transport's methods
        # without subclassing it).
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
        elif self._state != _DONE:
            where = "before the response headers" if self._state == _HEAD else "in the middle of the body"
            self._error = UpstreamError(
                f"upstream closed the connection {where}", "before_headers" if self._state == _HEAD else "mid_body"
            )
        self._wake()

    def data_received(self, data: bytes) -> None:
        if self.idle or self._state == _DONE:
            self._stray()  # nobody asked: the next exchange would read these bytes as its answer
            return
        self.got_bytes = True
        if self._state == _HEAD:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
            if self._state == _HEAD and self._head_bytes > MAX_HEAD_BYTES:
                raise UpstreamError("upstream response headers exceed 64 KiB", "before_headers")
        except (httptools.HttpParserError, UpstreamError) as exc:
            if self._state == _DONE and self._error is None:
                self._stray()  # the response was whole; what followed it was not asked for
            else:
                self._fail(exc)
        if self._buffered > HIGH_WATER and not self._paused and self._state != _DONE:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self):
        return False

    def _stray(self) -> None:
        self.keep_alive = False
        self.transport.close()

    def _fail(self, exc: Exception) -> None:
        if isinstance(exc, UpstreamError):
            error = exc
        else:
            cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else exc
            kind = "before_headers" if self._state == _HEAD else "mid_body"
            error = UpstreamError(f"malformed response from upstream ({cause})", kind)
        self._error = error
        self._state = _DONE
        self.keep_alive = False
        self.transport.close()

    # ---- llhttp callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._state != _HEAD:
            raise _BadResponse("a second response followed the first one")

    def on_status(self, reason: bytes) -> None:
        # llhttp lets control bytes through in the reason phrase; kvgate then writes its own.
        self.reason = reason if _REASON_PHRASE.fullmatch(reason) else b""

    def on_header(self, name: bytes, value: bytes) -> None:
        value = value.rstrip(b" \t")
        lower = name.lower()
        if lower == b"transfer-encoding":
            if self._chunked or value.lower() != b"chunked":
                raise _BadResponse(f"unsupported Transfer-Encoding {value[:40]!r}")
            self._chunked = True
        elif lower == b"content-length":
            self._length = int(value)  # llhttp checked: digits only, one header
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if not 100 <= status <= 599:
            raise _BadResponse(f"status {status} is outside 100-599")
        if status < 200:
            if status == 101:
                raise _BadResponse("101 Switching Protocols was not asked for")
            self.headers = []  # interim: the final response follows
            self._length = None
            self._chunked = False
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        if status in (204, 304) or self._chunked or self._length is not None:
            self._state = _BODY
        else:
            self._state = _UNTIL_CLOSE
            self.keep_alive = False

    def on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)

    def on_message_complete(self) -> None:
        if self.status:  # not an interim 1xx
            self._state = _DONE

    # ---- waiting ---------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if not waiter.done():
                waiter.set_result(None)

    def _on_timeout(self) -> None:
        self._timer = None
        self._error = UpstreamTimeout(f"upstream sent nothing for {self._read_timeout:g} s (upstream.read_timeout_sec)")
        self.keep_alive = False
        self._state = _DONE
        self.transport.close()
        self._wake()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        self._timer = self._loop.call_later(self._read_timeout, self._on_timeout)
        try:
            await waiter
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._waiter = None

    async def read_head(self) -> None:
        while self._state == _HEAD:
            if self._error is not None:
                raise self._error
            await self._wait()
        if self._error is not None and self.status == 0:
            raise self._error

    def take(self) -> bytes:
        """Everything buffered now (b"" if nothing), resuming a paused socket."""
        if not self._chunks:
            return b""
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def readany(self) -> bytes:
        while True:
            data = self.take()
            if data:
                return data
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return b""
            await self._wait()

    @property
    def complete(self) -> bool:
        return self._state == _DONE and self._error is None and not self._chunks


class UpstreamResponse:
    """The response of one exchange. Read it with `read()` or `readany()`; then it
    releases its connection itself. `close()` aborts it."""

    __slots__ = ("_conn", "_pool", "status", "reason", "headers", "_finished")

    def __init__(self, conn: _Connection, pool: UpstreamPool) -> None:
        self._conn = conn
        self._pool = pool
        self.status = conn.status
        self.reason = conn.reason
        self.headers = conn.headers
        self._finished = False

    def header(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lower-case bytes), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def content_type(self) -> bytes:
        value = self.header(b"content-type")
        return value.split(b";", 1)[0].strip().lower() if value else b""

    @property
    def content_length(self) -> int | None:
        value = self.header(b"content-length")
        return int(value) if value is not None and value.isdigit() else None

    async def read(self) -> bytes:
        parts = []
        while True:
            data = await self.readany()
            if not data:
                break
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def readany(self) -> bytes:
        if self._finished:
            return b""
        try:
            data = await self._conn.readany()
        except BaseException:
            self.close()
            raise
        if not data:
            self._finish()
        return data

    def _finish(self) -> None:
        self._finished = True
        self._pool._release(self._conn)

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._pool._discard(self._conn)


class UpstreamPool:
    """Keep-alive connections to one upstream base URL (http or https)."""

    def __init__(self, base_url: str, connect_timeout: float, read_timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL {base_url!r} must be http(s)://host[:port]")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl_module.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/").encode()
        default_port = (parts.scheme == "https" and self.port == 443) or (parts.scheme == "http" and self.port == 80)
        self._host_header = (self.host if default_port else f"{self.host}:{self.port}").encode()
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self.closed = False

    async def request(
        self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes | None
    ) -> UpstreamResponse:
        """Send one request; return once the response head has arrived."""
        lines = [
            method.encode(),
            b" ",
            self.prefix,
            target.encode("utf-8", "surrogateescape"),
            b" HTTP/1.1\r\nHost: ",
            self._host_header,
            b"\r\n",
        ]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        if body is not None:
            lines += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        else:
            lines.append(b"\r\n")
        payload = b"".join(lines)
        conn = await self._acquire()
        try:
            conn.transport.write(payload)
            await conn.read_head()
        except UpstreamError as exc:
            self._discard(conn)
            if conn.reused and not conn.got_bytes and exc.kind == "before_headers":
                conn = await self._connect()  # stale keep-alive connection: the server never saw it
                try:
                    conn.transport.write(payload)
                    await conn.read_head()
                except BaseException:
                    self._discard(conn)
                    raise
            else:
                raise
        except BaseException:
            self._discard(conn)
            raise
        return UpstreamResponse(conn, self)

    async def _acquire(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.closed or now - conn.idle_since > IDLE_SEC:
                self._discard(conn)
                continue
            conn.reused = True
            conn.idle = False
            return conn
        return await self._connect()

    async def _connect(self) -> _Connection:
        if self.closed:
            raise UpstreamConnectError("upstream pool is closed (replica removed)")
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop, self._read_timeout), self.host, self.port, ssl=self._ssl
                ),
                self._connect_timeout,
            )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connecting to {self.host}:{self.port} timed out after {self._connect_timeout:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        self._open.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        if conn.keep_alive and conn.complete and not conn.closed and not self.closed:
            conn._reset()
            conn.idle = True
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            self._discard(conn)

    def _discard(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if not conn.closed:
            conn.transport.close()
        conn.closed = True

    @property
    def in_use(self) -> int:
        return len(self._open) - len(self._idle)

    def close(self) -> None:
        """Close every connection, idle or busy."""
        self.closed = True
        for conn in list(self._open):
            self._discard(conn)
        self._idle.clear()
