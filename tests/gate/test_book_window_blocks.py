"""The book's running total of window footprints against the walk it replaces.

`SessionBook.window_blocks` is kept as a running total; these tests drive a book through
random admissions, repricings, releases (served or not), finishes, lost windows, purges
and abandoned attempts, and after every step compare it (and `older_window_blocks`) with
the footprints summed over `windows` afresh.
"""

from __future__ import annotations

import random

import pytest

from kvgate.gate.book import SessionBook, WindowEnd
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


@pytest.mark.parametrize("seed", range(8))
def test_the_running_total_equals_the_walk_after_every_step(seed):
    rng = random.Random(seed)
    book = SessionBook(grace=30.0, quiet_factor=4.0, quiet_floor=0.5)
    keys = [f"s{i}" for i in range(12)]
    pending: list[tuple[object, object]] = []  # (record, attempt) acquiring
    in_flight: list[tuple[object, object]] = []  # (record, attempt) holding a lease
    now = 0.0
    for _ in range(3000):
        now += rng.expovariate(2.0)
        op = rng.random()
        if op < 0.3:
            attempt = object()
            rec, _ = book.begin_attempt(rng.choice(keys), attempt, now, turn=str(rng.randrange(3)))
            pending.append((rec, attempt))
        elif op < 0.55 and pending:
            rec, attempt = pending.pop(rng.randrange(len(pending)))
            if book.records.get(rec.key) is rec and attempt in rec.attempts.values():
                footprint = rng.choice([None, rng.randrange(0, 400)])
                book.admit(rec, attempt, AdmissionReason.WINDOW_FITS.value, now, rng.random() < 0.8, footprint)
                in_flight.append((rec, attempt))
        elif op < 0.62 and pending:
            rec, attempt = pending.pop(rng.randrange(len(pending)))
            book.end_attempt(rec, attempt, now)
        elif op < 0.8 and in_flight:
            rec, attempt = in_flight.pop(rng.randrange(len(in_flight)))
            if rng.random() < 0.3:
                book.reprice(rec, rng.randrange(0, 400), rng.randrange(1, 6000), None)
            book.release(rec, now, attempt, served=rng.random() < 0.85)
        elif op < 0.85 and in_flight:
            rec, _ = rng.choice(in_flight)
            book.reprice(rec, rng.randrange(0, 400), rng.randrange(1, 6000), None)
        elif op < 0.9:
            book.finish(rng.choice(keys), now)
        elif op < 0.94:
            rec = book.records.get(rng.choice(keys))
            if rec is not None:
                book.drop_window(rec, now, rng.choice([WindowEnd.LOST, WindowEnd.REVOKED]))
        else:
            book.purge(now)
        assert book.window_blocks == _walked(book)
        for key in keys:
            rec = book.records.get(key)
            assert book.older_window_blocks(rec) == (
                _walked_older(book, key) if rec is not None and rec.has_window else _walked(book)
            )
    assert book.window_blocks == _walked(book)
