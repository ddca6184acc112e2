"""The pin books (`wire.pin_book.PinBook`) against a reference model on random histories."""

from __future__ import annotations

import random

import pytest

from kvgate.wire.pin_book import PinBook


def test_a_second_pin_replaces_the_first_and_returns_its_blocks():
    book = PinBook()
    assert book.pin("a", [1, 2, 3], 10, now=0) == ([1, 2, 3], [])
    assert book.pin("a", [1, 2, 3, 4], 10, now=1) == ([1, 2, 3, 4], [1, 2, 3])
    assert (book.num_pinned_sessions, book.num_pinned_blocks) == (1, 4)


def test_a_turn_with_no_blocks_leaves_the_sessions_pin_as_it_was():
    book = PinBook()
    book.pin("a", [1, 2], 10, now=0)
    assert book.pin("a", [], 10, now=1) == ([], [])
    assert book.pinned("a").block_ids == (1, 2)
    assert book.pin("b", [], 10, now=1) == ([], []) and book.pinned("b") is None


def test_a_shared_block_stays_pinned_until_its_last_holder_lets_go():
    book = PinBook()
    book.pin("a", [1, 2], 10, now=0)
    book.pin("b", [1, 5], 10, now=0)
    assert book.num_pinned_blocks == 3
    assert book.release("a") == [1, 2]
    assert book.holds(1) and not book.holds(2)
    assert book.release("b") == [1, 5] and book.num_pinned_blocks == 0
    assert book.release("b") == []


def test_pins_expire_at_their_own_ttl_capped_by_the_server():
    book = PinBook(max_ttl_sec=5)
    book.pin("short", [1], 1, now=0)
    book.pin("capped", [2], 100, now=0)
    book.pin("replaced", [3], 1, now=0)
    book.pin("replaced", [4], 50, now=0.5)  # its old expiry must not end the new pin
    assert book.expire(now=1.0) == [[1]]
    assert book.expire(now=4.9) == []
    assert book.expire(now=5.0) == [[2]]
    assert book.pinned("replaced") is not None
    assert book.expire(now=5.5) == [[4]]
    assert book.num_pinned_sessions == 0


def test_pins_yield_least_recently_pinned_first_and_are_counted():
    book = PinBook()
    book.pin("a", [1], 10, now=0)
    book.pin("b", [2], 10, now=1)
    book.pin("a", [3], 10, now=2)  # re-pinned: now the most recent
    assert book.yield_oldest() == [2]
    assert book.yield_oldest() == [3]
    assert book.yield_oldest() is None
    assert book.num_yields == 2


def test_max_ttl_must_be_positive():
    with pytest.raises(ValueError, match="max_ttl_sec"):
        PinBook(max_ttl_sec=0)


@pytest.mark.parametrize("seed", range(20))
def test_random_histories_keep_references_balanced(seed):
    """What the book tells a server to take and drop leaves exactly the live pins' blocks
    referenced, and its counts agree with a walk over the live pins."""
    rng = random.Random(seed)
    book, refs, now = PinBook(max_ttl_sec=8), {}, 0.0

    def drop(blocks):
        for block in blocks:
            refs[block] -= 1
            assert refs[block] >= 0

    for _ in range(300):
        now += rng.random()
        action = rng.random()
        session = f"s{rng.randrange(6)}"
        if action < 0.45:
            taken, released = book.pin(session, rng.sample(range(30), rng.randrange(1, 6)), rng.uniform(0.5, 12), now)
            for block in taken:
                refs[block] = refs.get(block, 0) + 1
            drop(released)
        elif action < 0.65:
            drop(book.release(session))
        elif action < 0.85:
            for blocks in book.expire(now):
                drop(blocks)
        else:
            drop(book.yield_oldest() or [])
        live = {s: book.pinned(s) for s in (f"s{i}" for i in range(6)) if book.pinned(s)}
        expected = {}
        for held in live.values():
            for block in held.block_ids:
                expected[block] = expected.get(block, 0) + 1
        assert {b: n for b, n in refs.items() if n} == expected
        assert book.num_pinned_blocks == len(expected) and book.num_pinned_sessions == len(live)
