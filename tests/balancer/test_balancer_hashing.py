"""Rendezvous hashing and bounded load, as pure functions."""

from __future__ import annotations

from collections import Counter

from kvgate.balancer.hashing import bounded_load_pick, rendezvous_order, unit_hash


def top(key: str, nodes: dict[str, float]) -> str:
    return rendezvous_order(key, list(nodes), lambda n: n, lambda n: nodes[n])[0]


def test_unit_hash_is_stable_and_in_the_open_unit_interval():
    assert unit_hash("r0", "abc") == unit_hash("r0", "abc")
    assert unit_hash("r0", "abc") != unit_hash("r1", "abc")
    values = [unit_hash("r0", str(i)) for i in range(1000)]
    assert all(0 < v < 1 for v in values)
    assert 0.4 < sum(values) / len(values) < 0.6


def test_known_value_is_the_same_in_every_process():
    # blake2b of (node, key) and nothing process-local: placement survives restarts and
    # is the same in every kvgate instance (unlike Python's salted hash()).
    assert unit_hash("r0", "session-1") == 0.6926188662882675
    assert top("session-1", {"r0": 1, "r1": 1, "r2": 1}) == top("session-1", {"r2": 1, "r1": 1, "r0": 1})


def test_keys_spread_evenly_over_equal_weights():
    nodes = {f"r{i}": 1.0 for i in range(4)}
    counts = Counter(top(f"s{i}", nodes) for i in range(4000))
    assert set(counts) == set(nodes)
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_weights_scale_the_share():
    counts = Counter(top(f"s{i}", {"light": 1.0, "heavy": 3.0}) for i in range(4000))
    assert 2.4 < counts["heavy"] / counts["light"] < 3.8, counts


def test_removing_a_node_moves_only_its_keys():
    nodes = {f"r{i}": 1.0 for i in range(5)}
    before = {f"s{i}": top(f"s{i}", nodes) for i in range(2000)}
    del nodes["r2"]
    after = {k: top(k, nodes) for k in before}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k in before if before[k] == "r2"}


def test_adding_a_node_takes_keys_only_for_itself():
    nodes = {f"r{i}": 1.0 for i in range(4)}
    before = {f"s{i}": top(f"s{i}", nodes) for i in range(2000)}
    nodes["r9"] = 1.0
    after = {k: top(k, nodes) for k in before}
    assert all(after[k] in (before[k], "r9") for k in before)
    assert 250 < sum(after[k] == "r9" for k in before) < 550


def test_bounded_load_keeps_order_until_over_the_bound():
    loads = {"a": 0, "b": 0, "c": 0}
    assert bounded_load_pick(["a", "b", "c"], loads.get, 1.25) == "a"
    loads = {"a": 10, "b": 0, "c": 2}
    # mean with the new request: 13/3; bound ceil(1.25 * 13/3) = 6: a is over it, b is next
    assert bounded_load_pick(["a", "b", "c"], loads.get, 1.25) == "b"
    loads = {"a": 5, "b": 5, "c": 5}
    assert bounded_load_pick(["a", "b", "c"], loads.get, 1.0) == "a"
    assert bounded_load_pick([], loads.get, 1.25) is None
