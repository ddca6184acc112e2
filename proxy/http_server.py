"""A lean HTTP/1.1 server core for the front door (asyncio.Protocol, no framework).

Why not aiohttp.web: on this path a framework's request and response objects,
router, middleware chain and payload streams cost as much CPU per request as the
whole upstream being proxied; the relay needs much less. This module knows HTTP
framing only; what a request means is the handler's business.

Contract with the handler, `async handler(request: HttpRequest, responder: Responder)`:
- The request arrives with its whole body read (bounded by `max_body_bytes`; a
  larger declared body is answered 413 without reading it, and the connection is
  closed). `Expect: 100-continue` is answered before the body is read.
- The handler answers once: `responder.send(...)` for a whole body, or
  `await responder.start(...)`, `await responder.write(chunk)`..., `await responder.end()`
  for a streamed one (chunked framing; close-delimited for HTTP/1.0 clients).
  `write` waits while the client's socket buffer is full (backpressure) and raises
  ConnectionResetError once the client is gone.
- When the client disconnects, the handler task is cancelled at once.
- Requests on one connection are handled one at a time, in order (pipelining safe).
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Awaitable, Callable, Iterable

log = logging.getLogger("kvgate.http")

MAX_HEAD_BYTES = 64 * 1024
LINGER_SEC = 2.0
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CHUNKED_END = b"0\r\n\r\n"

Header = tuple[bytes, bytes]


class HttpRequest:
    """One parsed request. `headers` maps lower-case names to values (str); `raw_headers`
    keeps the received (name, value) byte pairs in order, for relaying."""

    __slots__ = ("method", "path", "query", "version", "raw_headers", "headers", "body", "keep_alive")

    def __init__(self, method: str, path: str, query: str, version: str, raw_headers: list[Header],
                 headers: dict[str, str], keep_alive: bool) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.raw_headers = raw_headers
        self.headers = headers
        self.body = b""
        self.keep_alive = keep_alive


class _DateCache:
    """The Date header value, formatted at most once per second."""

    def __init__(self) -> None:
        self._second = 0
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


_date = _DateCache()


def response_head(status: int, headers: Iterable[Header], reason: bytes | None = None) -> list[bytes]:
    parts = [b"HTTP/1.1 ", str(status).encode(), b" ", reason or _REASONS.get(status, b"Unknown"),
             b"\r\nDate: ", _date.get(), b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    return parts


class Responder:
    """How a handler answers one request. See the module doc for the contract."""

    __slots__ = ("_protocol", "_keep_alive", "_chunked", "started", "finished", "status")

    def __init__(self, protocol: "FrontProtocol", keep_alive: bool, chunked_ok: bool) -> None:
        self._protocol = protocol
        self._keep_alive = keep_alive
        self._chunked = chunked_ok
        self.started = False
        self.finished = False
        self.status = 0

    def send(self, status: int, body: bytes, headers: Iterable[Header] = (), reason: bytes | None = None,
             close: bool = False) -> None:
        """A whole response in one write."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        if close:
            self._keep_alive = False
        parts = response_head(status, headers, reason)
        parts += (b"Content-Length: ", str(len(body)).encode(),
                  b"\r\n\r\n" if self._keep_alive else b"\r\nConnection: close\r\n\r\n", body)
        self._protocol.write(b"".join(parts))

    async def start(self, status: int, headers: Iterable[Header] = (), reason: bytes | None = None) -> None:
        """Send the head of a streamed response."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        parts = response_head(status, headers, reason)
        if self._chunked:
            parts.append(b"Transfer-Encoding: chunked\r\n\r\n" if self._keep_alive
                         else b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        else:
            self._keep_alive = False
            parts.append(b"Connection: close\r\n\r\n")
        self._protocol.write(b"".join(parts))
        await self._protocol.drain()

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self._chunked:
            self._protocol.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._protocol.write(data)
        await self._protocol.drain()

    async def end(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._chunked:
            self._protocol.write(_CHUNKED_END)

    @property
    def keep_alive(self) -> bool:
        return self._keep_alive


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]

_S_HEAD, _S_BODY, _S_CHUNK_SIZE, _S_CHUNK_DATA, _S_CHUNK_CRLF, _S_TRAILER, _S_BUSY, _S_CLOSED = range(8)


class FrontProtocol(asyncio.Protocol):
    """One client connection: parse requests, run the handler for each, in order."""

    def __init__(self, handler: Handler, max_body_bytes: int, connections: set) -> None:
        self._handler = handler
        self._max_body = max_body_bytes
        self._connections = connections
        self._loop = asyncio.get_event_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._state = _S_HEAD
        self._request: HttpRequest | None = None
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._remaining = 0
        self._task: asyncio.Task | None = None
        self._closed = False
        self._eof = False
        self._paused_writing = False
        self._drain_waiter: asyncio.Future | None = None
        self._reading_paused = False

    # ---- transport events ------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._connections.add(self)

    def connection_lost(self, exc) -> None:
        self._closed = True
        self._state = _S_CLOSED
        self._connections.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: withdraw the admission, abort the upstream
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("client disconnected"))
        self._drain_waiter = None

    def eof_received(self):
        # The client closed its side. HTTP clients do that to abort, not to half-close
        # and wait, so treat it as a disconnect: the transport closes and
        # connection_lost cancels any running handler.
        self._eof = True
        return False

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._drain_waiter = None

    def data_received(self, data: bytes) -> None:
        if self._state == _S_CLOSED:
            return  # lingering after a rejected request: discard
        self._buf += data
        if self._state == _S_BUSY:
            if len(self._buf) > MAX_HEAD_BYTES + self._max_body and not self._reading_paused:
                self._reading_paused = True
                self._transport.pause_reading()  # a client pipelining without limit waits
            return
        self._parse()

    # ---- writing (used by Responder) -------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionResetError("client disconnected")
        self._transport.write(data)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("client disconnected")
        if not self._paused_writing:
            return
        waiter = self._drain_waiter
        if waiter is None or waiter.done():
            waiter = self._drain_waiter = self._loop.create_future()
        await waiter

    # ---- parsing ---------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._buf
        while not self._closed:
            state = self._state
            if state == _S_HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        self._reject(431, "request headers exceed 64 KiB")
                    elif self._eof and not buf.strip():
                        self._transport.close()
                    return
                head = bytes(buf[:end])
                del buf[:end + 4]
                if not head.strip():
                    continue  # stray CRLF between requests
                if not self._start_request(head):
                    return
            elif state == _S_BODY:
                if len(buf) < self._remaining:
                    return
                self._request.body = bytes(buf[:self._remaining])
                del buf[:self._remaining]
                self._dispatch()
                return
            elif state == _S_CHUNK_DATA:
                take = min(self._remaining, len(buf))
                if take == 0:
                    return
                self._body_parts.append(bytes(buf[:take]))
                del buf[:take]
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _S_CHUNK_CRLF
            elif state in (_S_CHUNK_SIZE, _S_CHUNK_CRLF, _S_TRAILER):
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 4096:
                        self._reject(400, "malformed chunked request body")
                    return
                line = bytes(buf[:end])
                del buf[:end + 2]
                if state == _S_CHUNK_CRLF:
                    if line:
                        self._reject(400, "malformed chunked request body")
                        return
                    self._state = _S_CHUNK_SIZE
                elif state == _S_TRAILER:
                    if not line:
                        self._request.body = b"".join(self._body_parts)
                        self._body_parts = []
                        self._dispatch()
                        return
                else:
                    try:
                        size = int(line.split(b";", 1)[0].strip(), 16)
                    except ValueError:
                        self._reject(400, "malformed chunk size in the request body")
                        return
                    if size == 0:
                        self._state = _S_TRAILER
                        continue
                    self._body_size += size
                    if self._body_size > self._max_body:
                        self._reject(413, f"request body exceeds limits.max_body_bytes ({self._max_body}); "
                                     "send a smaller body or raise the limit", "body_too_large")
                        return
                    self._remaining = size
                    self._state = _S_CHUNK_DATA
            else:
                return

    def _start_request(self, head: bytes) -> bool:
        lines = head.split(b"\r\n")
        try:
            method, target, version = lines[0].split(b" ")
        except ValueError:
            self._reject(400, "malformed request line")
            return False
        if not version.startswith(b"HTTP/1."):
            self._reject(505, "only HTTP/1.x is supported")
            return False
        raw_headers: list[Header] = []
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name[-1:] in (b" ", b"\t"):
                self._reject(400, "malformed request header line")
                return False
            value = value.strip()
            raw_headers.append((name, value))
            key = name.decode("latin-1").lower()
            text = value.decode("utf-8", "surrogateescape")
            if key in headers:
                headers[key] = f"{headers[key]}, {text}"
            else:
                headers[key] = text
        target_s = target.decode("utf-8", "surrogateescape")
        path, _, query = target_s.partition("?")
        http10 = version == b"HTTP/1.0"
        connection = headers.get("connection", "").lower()
        keep_alive = ("keep-alive" in connection) if http10 else ("close" not in connection)
        request = HttpRequest(method.decode("latin-1"), path, query, version.decode("latin-1"), raw_headers,
                              headers, keep_alive)
        self._request = request
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _S_CHUNK_SIZE
            self._body_parts = []
            self._body_size = 0
            self._continue(headers)
            return True
        length_text = headers.get("content-length")
        if length_text is None:
            self._dispatch()
            return False
        if not length_text.isdigit():
            self._reject(400, f"bad Content-Length {length_text[:40]!r}")
            return False
        length = int(length_text)
        if length > self._max_body:
            self._reject(413, f"request body of {length} bytes exceeds limits.max_body_bytes ({self._max_body}); "
                         "send a smaller body or raise the limit", "body_too_large")
            return False
        if length == 0:
            self._dispatch()
            return False
        self._remaining = length
        self._state = _S_BODY
        self._continue(headers)
        return True

    def _continue(self, headers: dict[str, str]) -> None:
        if headers.get("expect", "").lower() == "100-continue" and not self._buf:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _reject(self, status: int, message: str, code: str = "invalid_request") -> None:
        """Answer a request the server cannot read, then close (the stream is out of sync).

        The close lingers: the write side shuts first and whatever the client still
        sends is discarded for LINGER_SEC, so a client busy uploading a body reads the
        error instead of a connection reset.
        """
        from proxy.errors import error_json  # the error shape is the proxy's, kept in one place
        self._state = _S_CLOSED
        self._buf.clear()
        responder = Responder(self, keep_alive=False, chunked_ok=True)
        responder.send(status, error_json(status, message, code), [(b"Content-Type", b"application/json")])
        transport = self._transport
        if transport.can_write_eof():
            transport.write_eof()
            self._loop.call_later(LINGER_SEC, transport.close)
        else:
            transport.close()

    # ---- running the handler -------------------------------------------------------

    def _dispatch(self) -> None:
        request = self._request
        self._request = None
        self._state = _S_BUSY
        responder = Responder(self, request.keep_alive and not self._eof, request.version == "HTTP/1.1")
        self._task = self._loop.create_task(self._run(request, responder))

    async def _run(self, request: HttpRequest, responder: Responder) -> None:
        try:
            await self._handler(request, responder)
        except asyncio.CancelledError:
            return  # the client left; nothing to answer
        except ConnectionResetError:
            return
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path)
            if not responder.started and not self._closed:
                from proxy.errors import error_json
                responder.send(500, error_json(500, "kvgate failed on this request; see its log", "internal_error"),
                               [(b"Content-Type", b"application/json")], close=True)
            else:
                responder._keep_alive = False
        finally:
            self._task = None
        self._after_response(responder)

    def _after_response(self, responder: Responder) -> None:
        if self._closed:
            return
        if not responder.finished or not responder.keep_alive or self._eof:
            self._transport.close()
            self._state = _S_CLOSED
            return
        self._state = _S_HEAD
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        if self._buf:
            self._parse()


class FrontServer:
    """Listens and hands every request to `handler`; `close()` stops and drops connections."""

    def __init__(self, handler: Handler, max_body_bytes: int) -> None:
        self._handler = handler
        self._max_body = max_body_bytes
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[FrontProtocol] = set()

    async def start(self, host: str, port: int, backlog: int = 2048) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: FrontProtocol(self._handler, self._max_body, self._connections), host, port,
            backlog=backlog, reuse_address=True)
        address = self._server.sockets[0].getsockname()
        return address[0], address[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                if conn._transport is not None:
                    conn._transport.close()
            await self._server.wait_closed()
            self._server = None
