"""The idle windows, indexed by when their sessions turn late (`window_lifetime.late_after`).

An idle window's session is *late* at `now` when `late_after(gap, replica_gap, floor) -
(now - idle_since) < 0`. A session with a gap of its own (`gap_ewma`) has a fixed
allowance `g` for the whole idle period; one without uses the replica's gap, which moves,
but is the same for all of them. So:

- `_shared` (sessions without a gap) holds them in the order they went idle
  (`OrderedSums` keyed by `idle_since`): whatever the replica's gap, the late ones are
  a prefix of that order (the test is monotone in `idle_since`, in floating point too),
  found by bisection, and their blocks are a prefix sum. O(log n).
- `_own` (sessions with a gap) turn late at a deadline `idle_since + g` that never
  moves, and a late one stays late while idle. `_pending` is a heap of the not yet late
  ones by deadline; a query first moves those due into `_late_own` (the exact test
  decides: deadlines within rounding of `now` are tested one by one), whose blocks
  `_late_own_blocks` sums. Amortized O(log n) per window.
- Heap entries of windows that left (their key no longer maps to the entry's sequence
  number in `_entry`) are stale and skipped; the heap is rebuilt when it holds more
  stale entries than live ones.

The index holds exactly the book's windows whose record is idle (no lease in flight,
no attempt acquiring), each with the footprint it had when it went idle (an idle
window's price does not change; `SessionBook.reprice` leaves idle windows alone).
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, Protocol, TypeVar

from kvgate.gate.ordered_sums import OrderedSums
from kvgate.gate.window_lifetime import late_after


class IdleWindow(Protocol):
    """What the index needs of an idle window's record (`book.SessionRecord` has it)."""

    key: str
    footprint: int
    idle_since: float
    gap_ewma: float | None


R = TypeVar("R", bound=IdleWindow)


def _margin(now: float) -> float:
    """A bound on the rounding between `idle_since + g < now` and the exact test."""
    return 8 * math.ulp(abs(now) + 1.0)


class LateIndex(Generic[R]):
    def __init__(self, floor: float) -> None:
        self.floor = floor
        self._shared: OrderedSums[R] = OrderedSums()
        self._pending: list[tuple[float, int, str]] = []  # (deadline, seq, key)
        self._entry: dict[str, tuple[int, R, float]] = {}  # key -> (seq, record, allowance)
        self._late_own: dict[str, R] = {}
        self._late_own_blocks = 0
        self._seq = 0

    def __len__(self) -> int:
        return len(self._shared) + len(self._entry) + len(self._late_own)

    def __contains__(self, key: str) -> bool:
        return key in self._shared or key in self._entry or key in self._late_own

    def add(self, rec: R) -> None:
        """The record's window went idle (at `rec.idle_since`)."""
        if rec.gap_ewma is None:
            self._shared.append(rec.key, rec, rec.footprint, rec.idle_since)
            return
        self._seq += 1
        allowance = late_after(rec.gap_ewma, None, self.floor)
        self._entry[rec.key] = (self._seq, rec, allowance)
        heapq.heappush(self._pending, (rec.idle_since + allowance, self._seq, rec.key))

    def remove(self, rec: R) -> None:
        """The record's window ended, or its record became active (no-op if not indexed)."""
        key = rec.key
        if self._shared.remove(key) or self._entry.pop(key, None) is not None:
            if len(self._pending) > 2 * len(self._entry) + 64:
                self._rebuild_heap()
            return
        if self._late_own.pop(key, None) is not None:
            self._late_own_blocks -= rec.footprint

    def _rebuild_heap(self) -> None:
        self._pending = [(rec.idle_since + allowance, seq, key) for key, (seq, rec, allowance) in self._entry.items()]
        heapq.heapify(self._pending)

    def _shared_boundary(self, replica_gap: float | None, now: float) -> int:
        allowance = late_after(None, replica_gap, self.floor)
        return self._shared.bisect(lambda since: allowance - (now - since) < 0)

    def _promote(self, now: float) -> None:
        """Move the sessions with a gap of their own that are late at `now` into `_late_own`."""
        heap, entry, margin = self._pending, self._entry, _margin(now)
        not_yet: list[tuple[float, int, str]] = []
        while heap and heap[0][0] <= now + margin:
            item = heapq.heappop(heap)
            held = entry.get(item[2])
            if held is None or held[0] != item[1]:
                continue  # stale
            _, rec, allowance = held
            if allowance - (now - rec.idle_since) < 0:
                del entry[item[2]]
                self._late_own[item[2]] = rec
                self._late_own_blocks += rec.footprint
            else:
                not_yet.append(item)
        for item in not_yet:
            heapq.heappush(heap, item)

    def _next_own(self, now: float) -> float | None:
        """The least `allowance - (now - idle_since)` among the not yet late sessions with a gap."""
        heap, entry = self._pending, self._entry
        while heap and (heap[0][2] not in entry or entry[heap[0][2]][0] != heap[0][1]):
            heapq.heappop(heap)
        if not heap:
            return None
        # The least deadline is the least wait up to rounding: test every deadline that close.
        limit = heap[0][0] + 2 * _margin(now) + 2 * math.ulp(abs(heap[0][0]) + 1.0)
        near: list[tuple[float, int, str]] = []
        best: float | None = None
        while heap and heap[0][0] <= limit:
            item = heapq.heappop(heap)
            near.append(item)
            held = entry.get(item[2])
            if held is not None and held[0] == item[1]:
                left = held[2] - (now - held[1].idle_since)
                best = left if best is None else min(best, left)
        for item in near:
            heapq.heappush(heap, item)
        return best

    def late_blocks(self, replica_gap: float | None, now: float) -> tuple[int, float | None]:
        """(the footprints of the late windows, the seconds until the next other one turns
        late or None). O(log n) amortized; `now` must not decrease between calls."""
        self._promote(now)
        boundary = self._shared_boundary(replica_gap, now)
        blocks = self._shared.sum_before(boundary) + self._late_own_blocks
        due = self._next_own(now)
        first = self._shared.first_from(boundary)
        if first is not None:
            left = late_after(None, replica_gap, self.floor) - (now - first[1])
            due = left if due is None else min(due, left)
        return blocks, due

    def late(self, replica_gap: float | None, now: float) -> list[R]:
        """The late windows (unordered). O(late windows + log n)."""
        self._promote(now)
        boundary = self._shared_boundary(replica_gap, now)
        return [*self._shared.items_before(boundary), *self._late_own.values()]
