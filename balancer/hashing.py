"""Rendezvous (highest-random-weight) hashing, as pure functions.

Invariant: the ranking of replicas for a key depends only on the key and on each
replica's (name, weight), never on which other replicas exist. So removing a replica
moves only the keys that ranked it first, and adding one takes keys only for itself.
Weights follow the logarithmic method: score = -weight / ln(u), where u is the
key's hash for that replica mapped into (0, 1); a replica of weight 2 wins about
twice as many keys as one of weight 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from hashlib import blake2b
from typing import TypeVar

T = TypeVar("T")

_TWO_64 = float(2**64)


def unit_hash(node: str, key: str) -> float:
    """A stable hash of (node, key) in the open interval (0, 1), same in every process."""
    digest = blake2b(f"{node}\x00{key}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / _TWO_64


def rendezvous_score(node: str, weight: float, key: str) -> float:
    """The weighted rendezvous score; the highest score wins the key."""
    return -weight / math.log(unit_hash(node, key))


def rendezvous_order(key: str, nodes: Iterable[T], name_of, weight_of) -> list[T]:
    """`nodes` sorted by descending score for `key` (ties broken by name, for determinism)."""
    return sorted(nodes, key=lambda n: (-rendezvous_score(name_of(n), weight_of(n), key), name_of(n)))


def bounded_load_pick(ordered: Sequence[T], load_of, load_factor: float) -> T | None:
    """The first node in rendezvous order whose load stays within the bound.

    The bound is ceil(load_factor x mean load), the mean counting the request being
    placed: (total + 1) / len(ordered). A node is skipped when taking one more would
    exceed it. With load_factor >= 1 at least one node always fits, so this returns
    None only for an empty sequence.
    """
    if not ordered:
        return None
    total = sum(load_of(n) for n in ordered)
    bound = math.ceil(load_factor * (total + 1) / len(ordered))
    for node in ordered:
        if load_of(node) + 1 <= bound:
            return node
    return ordered[0]
