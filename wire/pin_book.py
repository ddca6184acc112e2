"""The books of KV pins (`wire.kv_pins`): which blocks each session's pin holds, pure.

Both servers that keep pins, the vLLM plugin's retention connector and the simulated
replica, keep one `PinBook` per engine and do what it returns to their own block pool:
take one reference on each block of `pin`'s first list, drop one on each block of every
list of released blocks. The book never touches a pool, reads no clock (callers pass
`now`) and does no I/O, so both servers share the same rules.

Invariants:

- a session holds at most one pin; `pin` for a session that holds one replaces it;
- `_holders[b]` is the number of pins whose blocks include `b` (a block two sessions
  share, such as a common system prompt, is held twice and freed by the last);
  `num_pinned_blocks == len(_holders)`, every count positive;
- `_pins` is ordered by when each pin was taken, least recent first: the order in which
  pins yield;
- `_expiries` holds (expiry, serial, session) for every pin, and possibly stale entries
  of replaced or released pins (their serial no longer matches), dropped when popped.

Block id lists come back in the pin's order (a prompt's first block first); a server
that frees blocks into an LRU queue frees them in reverse, as vLLM frees a request's,
so the prompt's tail is evicted before its head.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.wire.kv_pins import MAX_PIN_TTL_SEC


@dataclass(frozen=True, slots=True)
class HeldPin:
    """One session's pin: its blocks and when it ends unless released or yielded first."""

    session: str
    block_ids: tuple[int, ...]
    expires_at: float
    serial: int


class PinBook:
    """The pins of one engine. Counts: `num_pinned_blocks`, `num_pinned_sessions`,
    `num_yields` (pins ended because a request needed their blocks)."""

    def __init__(self, max_ttl_sec: float = MAX_PIN_TTL_SEC):
        if not max_ttl_sec > 0:
            raise ValueError(f"max_ttl_sec must be positive, got {max_ttl_sec}")
        self.max_ttl_sec = max_ttl_sec
        self._pins: OrderedDict[str, HeldPin] = OrderedDict()
        self._holders: dict[int, int] = {}
        self._expiries: list[tuple[float, int, str]] = []
        self._serial = 0
        self.num_yields = 0

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._holders)

    @property
    def num_pinned_sessions(self) -> int:
        return len(self._pins)

    def pinned(self, session: str) -> HeldPin | None:
        return self._pins.get(session)

    def pin(self, session: str, block_ids: Iterable[int], ttl_sec: float, now: float) -> tuple[list[int], list[int]]:
        """Pin `block_ids` for `session` until `now + ttl_sec` (at most the cap). Returns the
        blocks to take a reference on, and the blocks of the pin it replaces, to drop one on.
        No blocks (a turn aborted before it computed a full block) changes nothing: the
        session keeps the window it had."""
        ids = tuple(dict.fromkeys(block_ids))  # a block once per pin, in order
        if not ids:
            return [], []
        released = self.release(session)
        self._serial += 1
        held = HeldPin(session, ids, now + min(ttl_sec, self.max_ttl_sec), self._serial)
        self._pins[session] = held
        for block in ids:
            self._holders[block] = self._holders.get(block, 0) + 1
        heapq.heappush(self._expiries, (held.expires_at, held.serial, session))
        return list(ids), released

    def release(self, session: str) -> list[int]:
        """End `session`'s pin; its blocks, to drop a reference on ([] when it holds none)."""
        held = self._pins.pop(session, None)
        if held is None:
            return []
        for block in held.block_ids:
            count = self._holders[block] - 1
            if count:
                self._holders[block] = count
            else:
                del self._holders[block]
        return list(held.block_ids)

    def expire(self, now: float) -> list[list[int]]:
        """End every pin whose time has come by `now`; the blocks of each, pin by pin."""
        released = []
        while self._expiries and self._expiries[0][0] <= now:
            _, serial, session = heapq.heappop(self._expiries)
            held = self._pins.get(session)
            if held is not None and held.serial == serial:
                released.append(self.release(session))
        return released

    def yield_oldest(self) -> list[int] | None:
        """End the least recently taken pin because a request needs blocks, and count it; its
        blocks, or None when no pin is held."""
        if not self._pins:
            return None
        session = next(iter(self._pins))
        self.num_yields += 1
        return self.release(session)

    def holds(self, block_id: int) -> bool:
        return block_id in self._holders
