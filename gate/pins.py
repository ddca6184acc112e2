"""KV pins from the gate's side (`kvgate.wire.kv_pins`): the gate pins the windows it admits
for, so the replica keeps their blocks while their sessions wait on tool calls, and
releases each pin when the window ends.

Pure rules (`wants_pin`, `pin_ttl`, `pin_session`) and one small shell (`PinReleases`):

- A turn is forwarded with a pin when `gate.pins` is `auto`, the replica's last kv answer
  says it keeps pins (`UsageReading.keeps_pins`) and has no CPU tier that holds what its
  GPU evicts (`pins_pay`), the route carries vLLM's
  `kv_transfer_params` (every prompt route: chat, completion, Anthropic messages,
  Responses), and its admission gives the session a window
  (opens or renews it). The pin's ttl is the time the session may be idle before it is
  late (`late_after`: its usual gap between turns, at least `late_floor_sec`, at most
  `idle_grace_sec`): the engine keeps the window while its session is expected back; a
  late session's blocks, the least likely to be read again soon, go back to the LRU
  order (its window lives on in the gate's books until it goes quiet), and a replica
  whose gate is gone drops the pin by itself.
- When the gate ends a window (finish, final_reply, quiet, grace, lost, revoked, reclaimed) of a
  session it pinned, it releases the pin once no turn of the session is in flight (a
  turn in flight pins when it ends, so its release waits for its lease's release).
  Releases are sent in batches, one `POST /v1/kvgate/release` per event-loop turn,
  never on a turn's path; a failed release is only logged (the pin's ttl ends it).

Invariant: `pinned` holds the sessions with a pinned turn forwarded since their last
release was queued; a session is queued for release at most once per pin.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kvgate.gate.readings import UsageReading
from kvgate.wire.kv_pins import MAX_SESSION_CHARS
from kvgate.wire.routes import PROMPT_KINDS

log = logging.getLogger(__name__)

PIN_MODES = ("auto", "off")
PIN_ROUTE_KINDS = PROMPT_KINDS  # vLLM takes `kv_transfer_params` on every prompt route
MIN_PIN_TTL_SEC = 1.0  # a pin outlives the turn's own response by at least this much

SendReleases = Callable[[tuple[str, ...]], Coroutine[Any, Any, None]]


def pins_pay(usage: UsageReading) -> bool:
    """Whether pinning windows on the replica saves it anything: it keeps pins, and no CPU
    tier holds what its GPU evicts (`UsageReading.tier_holds_evictions`). With such a tier a
    pin saves its window only a reload from CPU memory, while the blocks it keeps resident
    push other sessions' out of GPU memory, which then pay that reload in turn: vLLM's LRU
    order keeps the blocks read most recently, a pin those of the sessions the gate chose."""
    return usage.keeps_pins and not usage.tier_holds_evictions


def wants_pin(mode: str, usage: UsageReading | None, route_kind: str, window: bool) -> bool:
    """Whether an admitted turn is forwarded with a pin (module docstring)."""
    return mode == "auto" and window and route_kind in PIN_ROUTE_KINDS and usage is not None and pins_pay(usage)


def pin_ttl(late_after_sec: float, idle_grace_sec: float) -> float:
    """A window's pin lives while its session is expected back: until it is late (module
    docstring), at most the idle grace, at least MIN_PIN_TTL_SEC."""
    return max(MIN_PIN_TTL_SEC, min(late_after_sec, idle_grace_sec))


def pin_session(session_key: str) -> str:
    """The session id a pin names: the gate's session key, or its SHA-256 digest when it is
    longer than a pin may name (`wire.kv_pins.MAX_SESSION_CHARS`)."""
    if len(session_key) <= MAX_SESSION_CHARS:
        return session_key
    return hashlib.sha256(session_key.encode("utf-8", "surrogateescape")).hexdigest()


class PinReleases:
    """The pins one gate holds on its replica, and their releases, sent in batches."""

    def __init__(self, send: SendReleases) -> None:
        self._send = send
        self.pinned: set[str] = set()  # session keys with a pinned turn forwarded
        self._pending: dict[str, None] = {}  # pin sessions to release, in order
        self._flush: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_released = 0  # sessions sent in a release

    def pinned_turn(self, session_key: str) -> None:
        """A turn of the session goes out with a pin: a release queued for it is void."""
        self.pinned.add(session_key)
        self._pending.pop(pin_session(session_key), None)

    def end(self, session_key: str) -> None:
        """The session's window ended and no turn of it is in flight: release its pin."""
        if session_key not in self.pinned:
            return
        self.pinned.discard(session_key)
        self._pending[pin_session(session_key)] = None
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send_pending)

    def _send_pending(self) -> None:
        self._flush = None
        sessions, self._pending = tuple(self._pending), {}
        if not sessions:
            return
        self.num_released += len(sessions)
        task = asyncio.get_running_loop().create_task(self._send(sessions))
        self._tasks.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("releasing KV pins failed (their ttl ends them): %s", task.exception())

    def close(self) -> None:
        """The replica is gone: nothing more to release."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self._pending.clear()
        self.pinned.clear()
        for task in list(self._tasks):
            task.cancel()
