"""The book's logarithmic queries against the walks they replace.

`SessionBook.window_blocks` is a running total, `older_window_blocks` a Fenwick prefix
sum, `late_window_blocks` / `late_windows` an index of the idle windows; these tests
drive a book through random admissions, repricings, releases (served or not), finishes,
lost and reclaimed windows, purges (quiet and grace expiries) and abandoned attempts,
and after every step (a sample of the sessions, when there are many) compare each query
with the obvious O(n) walk over `windows`.
"""

from __future__ import annotations

import random

import pytest

from kvgate.gate.book import SessionBook, SessionRecord, WindowEnd
from kvgate.gate.policies.vocabulary import AdmissionReason


def _walked(book: SessionBook) -> int:
    return sum(rec.footprint for rec in book.windows.values())


def _walked_older(book: SessionBook, key: str) -> int:
    total = 0
    for other in book.windows.values():
        if other.key == key:
            return total
        total += other.footprint
    return total


def _check_against_walks(book: SessionBook, keys: list[str], now: float) -> None:
    assert book.window_blocks == _walked(book)
    idle = [rec for rec in book.windows.values() if rec.is_idle]
    assert len(book._idle_windows) == len(idle) and all(rec.key in book._idle_windows for rec in idle)
    for key in [*keys, None]:  # the sessions given, and no session
        rec = book.records.get(key) if key is not None else None
        assert book.older_window_blocks(rec) == (
            _walked_older(book, key) if rec is not None and rec.has_window else _walked(book)
        )
        late, due = book._late_windows_walk(rec, now)  # the walk the index replaced, kept for an idle `rec`
        assert book.late_window_blocks(rec, now) == (sum(other.footprint for other in late), due)
        assert book.late_windows(rec, now) == late


@pytest.mark.parametrize("seed", range(24))
def test_every_query_equals_its_walk_on_random_histories(seed):
    """Many sessions (the index compacts), gaps of their own or the replica's, a clock
    that often stands still (equal idle times) or steps by quarter seconds (sessions
    exactly at their allowance, not yet late), reclaims of late windows."""
    rng = random.Random(seed)
    book = SessionBook(grace=rng.choice([3.0, 30.0]), quiet_factor=rng.choice([2.0, 4.0]), quiet_floor=0.5)
    keys = [f"s{i}" for i in range(rng.choice([8, 12, 40, 150]))]
    few = len(keys) <= 12  # then every session is checked after every step
    pending: list[tuple[SessionRecord, object]] = []
    in_flight: list[tuple[SessionRecord, object]] = []
    now = 1000.0
    for step in range(2500):
        if rng.random() < 0.7:
            now += rng.choice([0.0, 0.001, 0.25, 0.25, rng.expovariate(4.0), rng.expovariate(0.5)])
        op = rng.random()
        if op < 0.3:
            attempt = object()
            rec, _ = book.begin_attempt(rng.choice(keys), attempt, now, turn=str(rng.randrange(2)))
            pending.append((rec, attempt))
        elif op < 0.55 and pending:
            rec, attempt = pending.pop(rng.randrange(len(pending)))
            if book.records.get(rec.key) is rec and attempt in rec.attempts.values():
                footprint = rng.choice([None, rng.randrange(0, 400)])
                book.admit(rec, attempt, AdmissionReason.WINDOW_FITS.value, now, rng.random() < 0.85, footprint)
                in_flight.append((rec, attempt))
        elif op < 0.6 and pending:
            rec, attempt = pending.pop(rng.randrange(len(pending)))
            book.end_attempt(rec, attempt, now)
        elif op < 0.82 and in_flight:
            rec, attempt = in_flight.pop(rng.randrange(len(in_flight)))
            book.release(rec, now, attempt, served=rng.random() < 0.9)
        elif op < 0.86 and in_flight:
            rec, _ = rng.choice(in_flight)
            book.reprice(rec, rng.randrange(0, 400), rng.randrange(1, 6000), None)
        elif op < 0.88:
            book.finish(rng.choice(keys), now)
        elif op < 0.9:
            rec = book.records.get(rng.choice(keys))
            if rec is not None:
                book.drop_window(rec, now, rng.choice([WindowEnd.LOST, WindowEnd.REVOKED]))
        elif op < 0.95:
            rec = book.records.get(rng.choice(keys))
            late = book._late_windows_walk(rec, now)[0]
            blocks = rng.randrange(0, 600)
            expected, freed = [], 0
            for other in late:
                if freed >= blocks:
                    break
                freed += other.footprint
                expected.append(other)
            assert book.reclaim_late_windows(rec, blocks, now) == freed
            assert all(not other.has_window for other in expected)
        else:
            book.purge(now)
        if few or step % 7 == 0 or op >= 0.9:
            _check_against_walks(book, keys if few else rng.sample(keys, 5), now)
    _check_against_walks(book, keys, now)
