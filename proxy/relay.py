"""Relaying a replica's answer to the client: the last step of a turn.

Invariants:
- Bodies are relayed byte for byte; SSE chunks are written as they arrive.
- A buffered answer (not SSE, not an unsized stream) is held up to
  `limits.max_buffered_response_bytes`, so an upstream that fails mid-body still gets
  the client a clean 502; past that it is relayed as it arrives.
- An upstream that breaks off after the headers went out ends an SSE stream with an
  error event; any other body is left unfinished, so the server closes the connection
  and the client cannot take a truncated body for a complete one.
- Every answer carries the lease's headers (replica, admission reason, wait).
- With a `UsageTap`, the answer's usage is read as it passes (`proxy.usage_tap`); a tap
  that strips takes the usage event kvgate asked for out of the stream, nothing else.
"""

from __future__ import annotations

import logging

from kvgate.balancer import Replica
from kvgate.proxy.errors import send_error, sse_error_event
from kvgate.proxy.http_client import UpstreamResponse
from kvgate.proxy.http_server import Responder
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.topology import merge_kvgate_headers
from kvgate.proxy.turn_hold import TurnLease
from kvgate.proxy.upstream import EXCHANGE_ERRORS, relayed_response_headers
from kvgate.proxy.usage_tap import UsageTap

log = logging.getLogger("kvgate.proxy")

H_REPLICA = b"x-kvgate-replica"
H_ADMISSION = b"x-kvgate-admission"
H_WAIT = b"x-kvgate-wait-ms"


def format_wait_ms(wait_ms: float) -> bytes:
    return b"0" if not wait_ms else f"{wait_ms:.1f}".encode()


def lease_headers(replica: Replica, lease: TurnLease) -> list[tuple[bytes, bytes]]:
    if not lease.reason:  # an ungated request: only the replica it went to
        return [(H_REPLICA, replica.name.encode())]
    return [
        (H_REPLICA, replica.name.encode()),
        (H_ADMISSION, str(lease.reason).encode()),
        (H_WAIT, format_wait_ms(lease.wait_ms)),
    ]


class AnswerRelay:
    """Writes replicas' answers to clients (one per front door: it remembers which
    replicas it warned about)."""

    def __init__(self, metrics: KvgateMetrics, max_buffered: int, gates: bool) -> None:
        self.metrics = metrics
        self._max_buffered = max_buffered
        self._gates = gates  # this kvgate gates: a replica that gates too is gated twice
        self._double_gating_warned: set[str] = set()

    async def relay(
        self,
        responder: Responder,
        upstream: UpstreamResponse,
        replica: Replica,
        lease: TurnLease,
        stream: bool,
        kind: str,
        tap: UsageTap | None = None,
    ) -> tuple[int, bool]:
        """Relay the upstream's answer: (status for metrics, completed normally). `tap`
        (answers under 400 only) reads its usage."""
        headers = self._answer_headers(upstream, replica, lease)
        is_sse = upstream.content_type == b"text/event-stream"
        if upstream.status >= 400:
            tap = None
        pending: list[bytes] = []
        if not (is_sse or (stream and upstream.content_length is None)):
            done = await self._buffered(responder, upstream, replica, lease, headers, tap, pending)
            if done is not None:
                return done
        # past the buffer limit, or streamed: relayed as it arrives
        await responder.start(upstream.status, headers, upstream.reason, None if is_sse else upstream.content_length)
        for data in pending:
            await responder.write(data)
        pending.clear()
        if not is_sse:
            tap = None  # an unbuffered answer that is not SSE: its usage is not read
        return await self._streamed(responder, upstream, replica, is_sse, kind, tap)

    def _answer_headers(
        self, upstream: UpstreamResponse, replica: Replica, lease: TurnLease
    ) -> list[tuple[bytes, bytes]]:
        """The answer's headers with the lease's; a replica that is itself a kvgate that
        gates is logged once (it is gated twice)."""
        headers, upstream_gated = merge_kvgate_headers(
            relayed_response_headers(upstream.headers), lease_headers(replica, lease)
        )
        if upstream_gated and self._gates and replica.name not in self._double_gating_warned:
            self._double_gating_warned.add(replica.name)
            log.error(
                "replica %s answers with x-kvgate-* headers: it is a kvgate, and this kvgate gates it a "
                "second time; give this one role: front_door with gate.mode: off (docs/ARCHITECTURE.md)",
                replica.name,
            )
        return headers

    async def _buffered(
        self,
        responder: Responder,
        upstream: UpstreamResponse,
        replica: Replica,
        lease: TurnLease,
        headers: list[tuple[bytes, bytes]],
        tap: UsageTap | None,
        pending: list[bytes],
    ) -> tuple[int, bool] | None:
        """Read the answer into `pending` up to the buffer limit. A whole answer is sent
        (or a break-off answered 502): its result. None: past the limit, `pending` holds
        what was read, and the rest is relayed as it arrives."""
        size = 0
        while size <= self._max_buffered:
            try:
                data = await upstream.readany()
            except EXCHANGE_ERRORS as exc:
                self.metrics.upstream_errors.labels(replica.name, "mid_body").inc()
                send_error(
                    responder,
                    502,
                    f"replica {replica.name} broke off its response ({exc}); retry the request",
                    "upstream_failed",
                    lease_headers(replica, lease),
                )
                return 502, False
            if not data:
                body = b"".join(pending)
                if tap is not None:
                    tap.whole(body)
                responder.send(upstream.status, body, headers, upstream.reason)
                return upstream.status, True
            pending.append(data)
            size += len(data)
        return None

    async def _streamed(
        self,
        responder: Responder,
        upstream: UpstreamResponse,
        replica: Replica,
        is_sse: bool,
        kind: str,
        tap: UsageTap | None,
    ) -> tuple[int, bool]:
        """Relay the rest of a started answer chunk by chunk. A break-off ends an SSE
        stream with an error event and leaves any other body unfinished."""
        while True:
            try:
                chunk = await upstream.readany()
            except EXCHANGE_ERRORS as exc:
                self.metrics.upstream_errors.labels(replica.name, "mid_stream").inc()
                if is_sse:
                    await responder.write(
                        sse_error_event(
                            f"replica {replica.name} broke off the stream ({exc}); the answer is incomplete, "
                            "retry the request",
                            "upstream_stream_broken",
                            anthropic=kind == "messages",
                        )
                    )
                    await responder.end()
                return upstream.status, False
            if not chunk:
                break
            if tap is not None:
                chunk = tap.feed(chunk)
                if not chunk:
                    continue
            await responder.write(chunk)
        if tap is not None:
            rest = tap.finish()
            if rest:
                await responder.write(rest)
        await responder.end()
        return upstream.status, True
