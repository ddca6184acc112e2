"""A lean HTTP/1.1 server core for the front door: llhttp (httptools) on asyncio.Protocol.

Why not aiohttp.web: on this path a framework's request and response objects,
router, middleware chain and payload streams cost as much CPU per request as the
whole upstream being proxied; the relay needs much less. Why llhttp: a proxy sits on
the trust boundary, and a hand-written parser let one client smuggle a request onto
a pooled upstream connection. llhttp (Node's parser, the one uvicorn uses) is strict
by default; `FrontProtocol` adds the checks it leaves to us (see its doc). This module
knows HTTP framing only; what a request means is the handler's business.

Contract with the handler, `async handler(request: HttpRequest, responder: Responder)`:
- Each request's head is first screened (`Screen`: the app's authentication); a
  refused one is answered and the connection closed before a byte of its body is read.
- The request arrives with its whole body read (bounded by `max_body_bytes`; a
  larger declared body is answered 413 without reading it, and the connection is
  closed). `Expect: 100-continue` is answered after the screen, before the body is read.
- The handler answers once: `responder.send(...)` for a whole body, or
  `await responder.start(...)`, `await responder.write(chunk)`..., `await responder.end()`
  for a streamed one (chunked framing, or the given Content-Length; close-delimited
  for HTTP/1.0 clients). `write` waits while the client's socket buffer is full
  (backpressure) and raises ConnectionResetError once the client is gone.
- When the client disconnects, the handler task is cancelled at once.
- Requests on one connection are handled one at a time, in order (pipelining safe);
  a request that cannot be read is answered in its turn, then the connection closes.

Limits (`proxy.settings.LimitsSettings`, the `limits` config section): head size and header count
per request, body size, header-read, body-read (between reads, and whole), idle keep-alive
and client write timeouts, and the number of client connections (at the limit, the
longest-waiting of the oldest connections without a screened request gives way to a new one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, cast

import httptools

from kvgate.proxy.flow_control import FlowControl
from kvgate.proxy.settings import LimitsSettings

if TYPE_CHECKING:
    from kvgate.proxy.front_server import FrontServer

log = logging.getLogger("kvgate.http")

LINGER_SEC = 2.0
MAX_PIPELINED = 64  # parsed requests waiting behind the one being answered before reading pauses
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_CHUNKED_END = b"0\r\n\r\n"
Header = tuple[bytes, bytes]
_FRAMING_NAME_LENGTHS = frozenset({len("transfer-encoding"), len("content-length"), len("expect")})


class HttpRequest:
    """One parsed request. `headers` maps lower-case names to values (str, repeated
    headers joined by ", "); `raw_headers` keeps the received (name, value) byte pairs
    in order, for relaying."""

    __slots__ = ("method", "path", "query", "version", "raw_headers", "headers", "body", "keep_alive", "tenant")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        version: str,
        raw_headers: list[Header],
        headers: dict[str, str],
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.raw_headers = raw_headers
        self.headers = headers
        self.body = b""
        self.keep_alive = keep_alive
        self.tenant: str | None = None  # set by the app's screen: the client key's tenant (proxy.tenancy)


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
    parts = [
        b"HTTP/1.1 ",
        str(status).encode(),
        b" ",
        reason or _REASONS.get(status, b"Unknown"),
        b"\r\nDate: ",
        _date.get(),
        b"\r\n",
    ]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    return parts


class Responder:
    """How a handler answers one request. See the module doc for the contract."""

    __slots__ = ("_protocol", "_keep_alive", "_chunked", "started", "finished", "status", "error_shape")

    def __init__(self, protocol: FrontProtocol, keep_alive: bool, chunked_ok: bool) -> None:
        self._protocol = protocol
        self._keep_alive = keep_alive
        self._chunked = chunked_ok
        self.started = False
        self.finished = False
        self.status = 0
        self.error_shape = "openai"  # the envelope of kvgate's own errors (proxy.errors.error_shape)

    def send(
        self, status: int, body: bytes, headers: Iterable[Header] = (), reason: bytes | None = None, close: bool = False
    ) -> None:
        """A whole response in one write."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        if close:
            self._keep_alive = False
        parts = response_head(status, headers, reason)
        parts += (
            b"Content-Length: ",
            str(len(body)).encode(),
            b"\r\n\r\n" if self._keep_alive else b"\r\nConnection: close\r\n\r\n",
            body,
        )
        self._protocol.write(b"".join(parts))

    async def start(
        self,
        status: int,
        headers: Iterable[Header] = (),
        reason: bytes | None = None,
        content_length: int | None = None,
    ) -> None:
        """Send the head of a streamed response: chunked, or exactly `content_length`
        bytes written with `write` when that is given."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        parts = response_head(status, headers, reason)
        if content_length is not None:
            self._chunked = False
            parts += (
                b"Content-Length: ",
                str(content_length).encode(),
                b"\r\n\r\n" if self._keep_alive else b"\r\nConnection: close\r\n\r\n",
            )
        elif self._chunked:
            parts.append(
                b"Transfer-Encoding: chunked\r\n\r\n"
                if self._keep_alive
                else b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            )
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


def _let_in(_request: HttpRequest, _has_body: bool) -> None:
    return None


class _Refusal(Exception):
    """A request the server answers itself with an error, then closes the connection."""

    def __init__(
        self, status: int, message: str, code: str = "invalid_request", headers: tuple[Header, ...] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers  # extra response headers (WWW-Authenticate)
        self.path = ""  # the request's path as far as it was read: the error's shape follows it


HeadRefusal = _Refusal  # what a Screen returns to refuse a request at its head
# Called with each request once its head is complete, before `100 Continue` and before a
# byte of its body is read: a HeadRefusal answers it and closes the connection; None
# lets it in. `has_body` says whether a body follows (Content-Length > 0, or chunked).
Screen = Callable[[HttpRequest, bool], "HeadRefusal | None"]


def body_too_large(size: int | None, limit: int) -> _Refusal:
    what = f"request body of {size} bytes" if size is not None else "request body"
    return _Refusal(
        413, f"{what} exceeds limits.max_body_bytes ({limit}); send a smaller body or raise the limit", "body_too_large"
    )


class FrontProtocol(asyncio.Protocol):
    """One client connection: parse requests with llhttp, run the handler for each, in order.

    llhttp (strict mode, httptools' default) already rejects: CR, LF, NUL and other
    control bytes in field values; invalid field names; obs-fold; bare LF line ends;
    Content-Length that is not all ASCII digits, duplicated, or sent with
    Transfer-Encoding; a chunked coding that is not last; malformed chunk sizes;
    control bytes and non-ASCII bytes in the request target. Checked here, in the
    callbacks (the head's state lives on the protocol: one call per header is the
    hot path):
    - the head size (request target plus header lines) and the header count;
    - Transfer-Encoding must be exactly `chunked` (llhttp accepts `gzip, chunked`,
      a coding nobody here can undo) and only on HTTP/1.1;
    - the HTTP version: 1.0 or 1.1;
    - optional whitespace is stripped from the end of values (llhttp strips the start);
    - trailer fields of a chunked body are discarded, never merged into the headers.

    Phases, for the timeouts the server's sweeper enforces: "idle" (waiting for a
    request: keep-alive timeout), "head" (a request began: header timeout), "body"
    (body-read timeout, restarted by every read, and the body deadline, which is not),
    "busy" (the handler runs; the write timeout applies while the client's socket buffer
    stays full).

    Each head is screened (`Screen`, the app's authentication) before its body is read:
    a request refused there costs no body bytes and gets no `100 Continue`.
    """

    def __init__(self, handler: Handler, limits: LimitsSettings, server: FrontServer, screen: Screen = _let_in) -> None:
        self._handler = handler
        self._screen = screen
        self._limits = limits
        self._server = server
        self._loop = asyncio.get_event_loop()
        # Set by connection_made, which asyncio runs before any other callback.
        self._transport: asyncio.Transport
        self._parser = httptools.HttpRequestParser(self)
        self._max_head = limits.max_head_bytes
        self._max_headers = limits.max_headers
        self._in_head = False  # between the start of a request and the end of its head
        self._messages = 0  # requests begun on this connection
        self._url = b""
        self._head_size = 0  # bytes of the target and header lines parsed so far
        self._head_pending = 0  # bytes received in packets that ended inside the head
        self._raw_headers: list[Header] = []
        self._headers: dict[str, str] = {}
        self._chunked = False
        self._content_length: int | None = None
        self._expect_continue = False
        self._request: HttpRequest | None = None
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._queue: deque = deque()  # parsed requests (or a final _Refusal) waiting their turn
        self._queued_bytes = 0
        self._task: asyncio.Task | None = None
        self._closed = False
        self._reading_done = False  # nothing more is parsed: a refusal or an upgrade ended the stream
        self._eof = False
        self._flow: FlowControl  # backpressure both ways (set with the transport)
        self.phase = "idle"
        self.deadline = 0.0  # when the current phase's timeout expires (monotonic)
        self._body_deadline = 0.0  # when the body being read must have arrived whole

    # ---- transport events ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport (uvloop's has asyncio.Transport's methods without
        # subclassing it).
        self._transport = cast(asyncio.Transport, transport)
        self._flow = FlowControl(self._transport)
        self._server.connections.add(self)
        self._server.displaceable(self, True)
        now = time.monotonic()
        self.deadline = now + self._limits.header_timeout_sec

    def connection_lost(self, exc) -> None:
        self._closed = True
        self._reading_done = True
        self._server.connections.discard(self)
        self._server.displaceable(self, False)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: withdraw the admission, abort the upstream
        self._flow.connection_lost()

    def eof_received(self):
        # The client closed its side. HTTP clients do that to abort, not to half-close
        # and wait, so treat it as a disconnect: the transport closes and
        # connection_lost cancels any running handler.
        self._eof = True
        return False

    def pause_writing(self) -> None:
        self._flow.pause_writing()

    def resume_writing(self) -> None:
        self._flow.resume_writing()

    def data_received(self, data: bytes) -> None:
        if self._reading_done:
            return  # lingering after a refused request, or after an upgrade request: discard
        in_head, begun = self._in_head, self._messages
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade request (h2c, websocket) was answered as plain HTTP/1.1; what
            # follows it is in the other protocol: stop reading, close after the answers.
            self._reading_done = True
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if not isinstance(refusal, _Refusal):
                raise
            self._refuse(refusal)
        except httptools.HttpParserInvalidMethodError:
            self._refuse(_Refusal(400, "malformed request line (unknown method)"))
        except httptools.HttpParserInvalidURLError as exc:
            self._refuse(_Refusal(400, f"malformed request target ({exc}); percent-encode it"))
        except httptools.HttpParserError as exc:
            self._refuse(_Refusal(400, f"malformed request ({exc})"))
        if in_head and self._in_head and self._messages == begun and not self._reading_done:
            # llhttp buffers a header line until it ends, out of the callbacks' sight:
            # count the packets that arrive wholly inside one head, so that a
            # never-ending header value is bounded too.
            self._head_pending += len(data)
            if self._head_pending > self._max_head:
                self._refuse(self._head_too_large())
                return
        if not self._closed and self._backlogged():
            self._flow.pause_reading()  # a client pipelining without limit waits

    def _backlogged(self) -> bool:
        """A client pipelining without limit waits: too many requests, or too many body
        bytes, are parsed and waiting behind the one being answered."""
        return (
            len(self._queue) >= MAX_PIPELINED
            or self._queued_bytes > self._limits.max_head_bytes + self._limits.max_body_bytes
        )

    # ---- llhttp callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._messages += 1
        self._in_head = True
        self._url = b""
        self._head_size = self._head_pending = 0
        self._raw_headers = []
        self._headers = {}
        self._chunked = self._expect_continue = False
        self._content_length = None
        self.phase = "head"
        self._server.displaceable(self, True)
        now = time.monotonic()
        self.deadline = now + self._limits.header_timeout_sec

    def _head_too_large(self) -> _Refusal:
        return _Refusal(431, f"request head exceeds limits.max_head_bytes ({self._max_head} bytes)", "head_too_large")

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > self._max_head:
            raise self._head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        size = self._head_size = self._head_size + len(name) + len(value) + 4
        if size > self._max_head:
            raise self._head_too_large()
        if not self._in_head:
            # A chunked body's trailer field (llhttp reports it like a header): discarded
            # (RFC 9110 6.5.1). Merged, a trailer Authorization or session header would act
            # after the head was screened, unseen by an ingress that filters headers.
            return
        raw_headers = self._raw_headers
        if len(raw_headers) >= self._max_headers:
            raise _Refusal(
                431, f"request has more than limits.max_headers ({self._max_headers}) headers", "too_many_headers"
            )
        value = value.rstrip(b" \t")
        key = name.decode("latin-1").lower()
        if len(key) in _FRAMING_NAME_LENGTHS:
            if key == "transfer-encoding":
                if self._chunked or value.lower() != b"chunked":
                    raise _Refusal(
                        400,
                        f"Transfer-Encoding {value[:40]!r} is not supported; send the body with "
                        "Content-Length or as 'Transfer-Encoding: chunked' alone",
                        "bad_framing",
                    )
                self._chunked = True
            elif key == "content-length":
                self._content_length = int(value)  # llhttp checked: digits only, one header
            elif key == "expect":
                self._expect_continue = value.lower() == b"100-continue"
        raw_headers.append((name, value))
        text = value.decode("utf-8", "surrogateescape")
        headers = self._headers
        previous = headers.get(key)
        headers[key] = text if previous is None else f"{previous}, {text}"

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":
            raise _Refusal(505, f"HTTP/{version} is not supported; use HTTP/1.1", "http_version_not_supported")
        if self._chunked and version == "1.0":
            raise _Refusal(400, "Transfer-Encoding is not allowed in an HTTP/1.0 request", "bad_framing")
        length = self._content_length
        if length is not None and length > self._limits.max_body_bytes:
            raise body_too_large(length, self._limits.max_body_bytes)
        target = self._url.decode("latin-1")  # llhttp admits only ASCII here
        path, _, query = target.partition("?")
        if "#" in query:
            query = query.partition("#")[0]
        request = self._request = HttpRequest(
            parser.get_method().decode("latin-1"),
            path,
            query,
            "HTTP/" + version,
            self._raw_headers,
            self._headers,
            parser.should_keep_alive(),
        )
        refusal = self._screen(request, self._chunked or bool(length))
        if refusal is not None:
            raise refusal  # before 100 Continue and before any body byte
        self._server.displaceable(self, False)  # screened: it holds a request now
        self._body_parts = []
        self._body_size = 0
        self.phase = "body"
        now = time.monotonic()
        self._body_deadline = now + self._limits.body_deadline_sec
        self.deadline = min(now + self._limits.body_timeout_sec, self._body_deadline)
        if self._expect_continue and (self._chunked or length) and self._task is None and not self._queue:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, data: bytes) -> None:
        self._body_size += len(data)
        if self._body_size > self._limits.max_body_bytes:
            raise body_too_large(None, self._limits.max_body_bytes)
        self._body_parts.append(data)
        self._queued_bytes += len(data)
        self.deadline = min(time.monotonic() + self._limits.body_timeout_sec, self._body_deadline)

    def on_message_complete(self) -> None:
        request = self._request
        assert request is not None  # llhttp calls on_headers_complete, which builds it, first
        self._request = None
        parts = self._body_parts
        if parts:
            request.body = parts[0] if len(parts) == 1 else b"".join(parts)
            self._body_parts = []
        self.phase = "idle"
        now = time.monotonic()
        self.deadline = now + self._limits.keepalive_timeout_sec
        if self._task is None and not self._queue:
            self._dispatch(request)
        else:
            self._queue.append(request)

    # ---- writing (used by Responder) -------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionResetError("client disconnected")
        self._transport.write(data)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("client disconnected")
        await self._flow.drain()

    # ---- refusing --------------------------------------------------------------------

    def _refuse(self, refusal: _Refusal) -> None:
        """Stop reading; answer `refusal` once the requests before it are answered."""
        self._reading_done = True
        self._in_head = False
        refusal.path = self._url.decode("latin-1").partition("?")[0]  # the target as far as it was read
        if self._task is None and not self._queue:
            self._send_refusal(refusal)
        else:
            self._queue.append(refusal)

    def _send_refusal(self, refusal: _Refusal) -> None:
        """Answer a request the server cannot read, then close (the stream is out of sync).

        The close lingers: the write side shuts first and whatever the client still
        sends is discarded for LINGER_SEC, so a client busy uploading a body reads the
        error instead of a connection reset.
        """
        from kvgate.proxy.errors import error_json, error_shape  # the error shape is the proxy's, kept in one place

        self.phase = "closing"
        if self._closed:
            return
        self._server.displaceable(self, True)
        responder = Responder(self, keep_alive=False, chunked_ok=True)
        shape = error_shape(refusal.path)
        responder.send(
            refusal.status,
            error_json(refusal.status, refusal.message, refusal.code, shape=shape),
            [(b"Content-Type", b"application/json"), *refusal.headers],
        )
        transport = self._transport
        self._flow.resume_reading()  # keep draining what the client sends while lingering
        if transport.can_write_eof():
            transport.write_eof()
            self._loop.call_later(LINGER_SEC, transport.close)
        else:
            transport.close()

    @property
    def evictable(self) -> bool:
        """Whether the server may close this connection to make room for a new one: it holds
        no request that passed the screen (it is idle, mid-head or closing after a refusal)."""
        return not self._closed and self._task is None and not self._queue and self.phase != "body"

    def evict(self) -> None:
        self._closed = True
        self._transport.abort()

    def expire(self, now: float) -> None:
        """Called by the server's sweeper: close a connection whose phase timed out."""
        if self._closed:
            return
        if self._flow.writing_paused and now - self._flow.write_blocked_since > self._limits.write_timeout_sec:
            self._transport.abort()  # the client stopped reading: drop it and what it holds
            return
        if self._task is not None or self._queue or self.phase == "closing" or now < self.deadline:
            return
        if self.phase == "idle":
            self._transport.close()
        else:
            what = "request head" if self.phase == "head" else "request body"
            key = "header_timeout_sec" if self.phase == "head" else "body_timeout_sec"
            if self.phase == "body" and now >= self._body_deadline:
                what, key = "whole request body", "body_deadline_sec"
            self._refuse(_Refusal(408, f"the {what} did not arrive within limits.{key}", "request_timeout"))

    # ---- running the handler -------------------------------------------------------

    def _dispatch(self, request: HttpRequest) -> None:
        self._queued_bytes -= len(request.body)
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
                from kvgate.proxy.errors import error_json

                responder.send(
                    500,
                    error_json(
                        500, "kvgate failed on this request; see its log", "internal_error", shape=responder.error_shape
                    ),
                    [(b"Content-Type", b"application/json")],
                    close=True,
                )
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
            self._reading_done = True
            return
        if self.phase == "idle":
            now = time.monotonic()
            self.deadline = now + self._limits.keepalive_timeout_sec
            self._server.displaceable(self, True)
        if self._queue:
            item = self._queue.popleft()
            if isinstance(item, _Refusal):
                self._send_refusal(item)
                return
            self._dispatch(item)
        elif self._reading_done:
            self._transport.close()  # after an upgrade request: nothing more to read
            return
        if self._flow.reading_paused and not self._backlogged():
            self._flow.resume_reading()
