"""Backpressure for one front connection, both ways (the transport's pause/resume).

Invariants:
- Writing: while the transport's buffer is over its high-water mark (`pause_writing`),
  `drain` waits; `resume_writing` wakes every waiter, and a lost connection fails them
  with ConnectionResetError, so no handler waits on a client that left.
- `write_blocked_since` is when writing last paused: the server's write timeout reads it.
- Reading: paused at most once and resumed at most once per pause, so the transport's
  pause_reading/resume_reading always alternate.
"""

from __future__ import annotations

import asyncio
import time


class FlowControl:
    """The pause state of a connection's reading and writing, and the writers waiting to drain."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.writing_paused = False
        self.write_blocked_since = 0.0  # monotonic time writing last paused
        self.reading_paused = False
        self._drain_waiter: asyncio.Future | None = None

    # ---- writing -------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.writing_paused = True
        self.write_blocked_since = time.monotonic()

    def resume_writing(self) -> None:
        self.writing_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._drain_waiter = None

    async def drain(self) -> None:
        """Wait until the transport takes writes again (at once when it is not paused)."""
        if not self.writing_paused:
            return
        waiter = self._drain_waiter
        if waiter is None or waiter.done():
            waiter = self._drain_waiter = asyncio.get_running_loop().create_future()
        await waiter

    def connection_lost(self) -> None:
        """Fail the writers waiting to drain: the client is gone."""
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("client disconnected"))
        self._drain_waiter = None

    # ---- reading -------------------------------------------------------------------

    def pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            self._transport.resume_reading()
