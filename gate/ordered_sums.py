"""Entries kept in the order they were added, with running sums of their values.

`OrderedSums` backs the session book's logarithmic queries (`gate.book`): the windows in
the order they opened (`older_window_blocks`: the footprints of the windows before one)
and the idle windows in the order they went idle (`gate.late_index`).

Invariants:
- Every live entry has one slot; slots rise in the order entries were added, so a
  slot's rank among the live slots is the entry's rank. A removed entry leaves a hole
  (value 0, no record) until the next compaction, which keeps the live entries' order.
- `_tree` is a Fenwick tree over the slots: `_prefix(i)` is the sum of the values of
  slots 0..i-1, `_count(i)` the number of live entries among them; both O(log n).
  It is brought up to date lazily: an addition, removal or change of value records its
  deltas per slot in `_pending` (O(1), a slot's deltas coalesce), and the first query
  after them applies them (O(log n) each) or, when they are many, rebuilds the tree from
  the slots (O(n)); so updates with no query between them (a gate with nothing to hold)
  cost O(1), and no update costs more than O(log n) amortized. `total` is always exact.
- `_keys[slot]` is the entry's sort key (holes keep theirs): non-decreasing over the
  slots, so `bisect` finds a boundary in O(log n). An entry added with a key below the
  last one re-sorts the slots (stable: equal keys keep the order they were added in).
- Compaction runs when the slots are full: it keeps the live entries and doubles their
  room, so its O(n) is paid once per n additions (amortized O(1)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
MIN_SLOTS = 64


class OrderedSums(Generic[T]):
    """Entries (a key string, an item, an int value, a float sort key) in order of addition."""

    __slots__ = ("_slot", "_items", "_values", "_keys", "_tree", "_counts", "_next", "total", "_sorted", "_pending")

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self.total = 0  # sum of the live entries' values
        self._next = 0  # the next free slot
        self._sorted = True
        self._pending: dict[int, tuple[int, int]] = {}  # slot -> (value, count) deltas not yet in the tree
        self._reset([])

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: str) -> bool:
        return key in self._slot

    # -- Fenwick tree

    def _defer(self, slot: int, value: int, count: int) -> None:
        """Record a change of a slot's value and liveness for the tree's next query."""
        pending = self._pending.get(slot)
        self._pending[slot] = (value, count) if pending is None else (pending[0] + value, pending[1] + count)

    def _flush(self) -> None:
        """Bring the tree up to date with the pending changes (before any query of it)."""
        pending = self._pending
        if not pending:
            return
        if len(pending) * len(self._tree).bit_length() > len(self._tree):  # cheaper to rebuild
            self._build_tree()
        else:
            for slot, (value, count) in pending.items():
                if value or count:
                    self._add(slot, value, count)
        pending.clear()

    def _build_tree(self) -> None:
        """The tree from the slots' values and liveness, O(n): push each node into its parent."""
        size = len(self._items)
        tree = [0, *self._values]
        counts = [0] + [0 if item is None else 1 for item in self._items]
        for i in range(1, size + 1):
            parent = i + (i & -i)
            if parent <= size:
                tree[parent] += tree[i]
                counts[parent] += counts[i]
        self._tree, self._counts = tree, counts

    def _add(self, slot: int, value: int, count: int) -> None:
        tree, counts, i = self._tree, self._counts, slot + 1
        size = len(tree)
        while i < size:
            tree[i] += value
            counts[i] += count
            i += i & -i

    def _prefix(self, n: int) -> int:
        """Sum of the values of slots 0..n-1."""
        tree, total = self._tree, 0
        while n > 0:
            total += tree[n]
            n &= n - 1
        return total

    def _count(self, n: int) -> int:
        """Live entries among slots 0..n-1."""
        counts, total = self._counts, 0
        while n > 0:
            total += counts[n]
            n &= n - 1
        return total

    def _kth(self, k: int) -> int:
        """The slot of the k-th live entry (1-based); k must be <= len(self)."""
        counts, pos, step = self._counts, 0, 1 << (len(self._counts) - 1).bit_length()
        while step:
            if pos + step < len(counts) and counts[pos + step] < k:
                pos += step
                k -= counts[pos]
            step >>= 1
        return pos

    def _reset(self, live: list[tuple[str, T, int, float]]) -> None:
        """Lay the live entries (in order) out in fresh slots with room to double."""
        size = max(MIN_SLOTS, 2 * len(live))
        self._items: list[T | None] = [None] * size
        self._values = [0] * size
        self._keys = [0.0] * size
        self._slot = {}
        for slot, (key, item, value, sort_key) in enumerate(live):
            self._slot[key] = slot
            self._items[slot] = item
            self._values[slot] = value
            self._keys[slot] = sort_key
        self._next = len(live)
        self._pending.clear()  # the new tree holds every change
        self._build_tree()

    def _item(self, slot: int) -> T:
        item = self._items[slot]
        assert item is not None, f"slot {slot} is a hole"
        return item

    def _live(self) -> list[tuple[str, T, int, float]]:
        by_slot = sorted(self._slot.items(), key=lambda kv: kv[1])
        return [(key, self._item(s), self._values[s], self._keys[s]) for key, s in by_slot]

    # -- operations

    def append(self, key: str, item: T, value: int, sort_key: float = 0.0) -> None:
        """Add an entry after every live one (its key must not be live)."""
        if self._next == len(self._items):
            self._reset(self._live())
        slot = self._next
        if slot and sort_key < self._keys[slot - 1]:
            self._sorted = False
        self._next += 1
        self._slot[key] = slot
        self._items[slot] = item
        self._values[slot] = value
        self._keys[slot] = sort_key
        self._defer(slot, value, 1)
        self.total += value
        if not self._sorted:  # out of key order (a clock that stepped back): re-sort, stable
            self._reset(sorted(self._live(), key=lambda entry: entry[3]))
            self._sorted = True

    def remove(self, key: str) -> bool:
        """Drop the entry; False if it was not live."""
        slot = self._slot.pop(key, None)
        if slot is None:
            return False
        value = self._values[slot]
        self._defer(slot, -value, -1)
        self.total -= value
        self._items[slot] = None
        self._values[slot] = 0
        return True

    def set_value(self, key: str, value: int) -> None:
        """Change a live entry's value (no-op for a key not live)."""
        slot = self._slot.get(key)
        if slot is not None:
            delta = value - self._values[slot]
            self._values[slot] = value
            self._defer(slot, delta, 0)
            self.total += delta

    def rank(self, key: str) -> int:
        """The slot boundary before a live entry (for `sum_before` and `items_before`)."""
        return self._slot[key]

    def sum_before(self, boundary: int) -> int:
        """Sum of the values of the live entries in the slots before `boundary`."""
        self._flush()
        return self._prefix(boundary)

    def bisect(self, before: Callable[[float], bool]) -> int:
        """The first slot whose sort key fails `before` (a predicate true on a prefix of the
        keys, as they are ordered): the live entries before it are those it holds for."""
        keys, lo, hi = self._keys, 0, self._next
        while lo < hi:
            mid = (lo + hi) // 2
            if before(keys[mid]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def first_from(self, boundary: int) -> tuple[T, float] | None:
        """The first live entry at or after slot `boundary` (its item and sort key), or None."""
        self._flush()
        k = self._count(boundary) + 1
        if k > len(self._slot):
            return None
        slot = self._kth(k)
        return self._item(slot), self._keys[slot]

    def items_before(self, boundary: int) -> Iterator[T]:
        """The live entries' items in the slots before `boundary`, in order (O(boundary))."""
        for slot in range(min(boundary, self._next)):
            item = self._items[slot]
            if item is not None:
                yield item
