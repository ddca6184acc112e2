"""Balancer.choose: sticky sessions, failover, drain, bounded load, anonymous spread."""

from __future__ import annotations

from collections import Counter

import pytest

from kvgate.balancer import Balancer, ReplicaRegistry
from kvgate.balancer.registry import RegistryError
from kvgate.balancer.settings import BalancerSettings


def make(n=3, algorithm="rendezvous", load_factor=1.25):
    registry = ReplicaRegistry()
    for i in range(n):
        registry.add(f"r{i}", f"http://127.0.0.1:{8100 + i}")
    return registry, Balancer(registry, BalancerSettings(algorithm=algorithm, load_factor=load_factor))


def test_same_session_same_replica():
    _, balancer = make()
    for i in range(100):
        assert balancer.choose(f"s{i}") is balancer.choose(f"s{i}")


def test_unhealthy_replica_moves_only_its_sessions_and_they_come_back():
    registry, balancer = make(4)
    before = {f"s{i}": balancer.choose(f"s{i}").name for i in range(400)}
    registry.mark_failed(registry.get("r1"))
    during = {k: balancer.choose(k).name for k in before}
    assert {k for k in before if before[k] != during[k]} == {k for k in before if before[k] == "r1"}
    assert "r1" not in during.values()
    registry.record_check(registry.get("r1"), True)
    assert {k: balancer.choose(k).name for k in before} == before


def test_draining_and_removed_replicas_get_no_new_sessions():
    registry, balancer = make(3)
    registry.drain("r0")
    registry.remove("r1")
    assert {balancer.choose(f"s{i}").name for i in range(100)} == {"r2"}
    assert balancer.choose(None).name == "r2"


def test_no_routable_replica_is_none():
    registry, balancer = make(2)
    for r in registry.all():
        registry.mark_failed(r)
    assert balancer.choose("s") is None
    assert balancer.choose(None) is None


def test_exclude_gives_the_next_choice():
    _, balancer = make(3)
    first = balancer.choose("s")
    second = balancer.choose("s", exclude=first)
    assert second is not first


def test_anonymous_goes_to_the_least_loaded():
    registry, balancer = make(3)
    registry.get("r0").in_flight = 5
    registry.get("r1").in_flight = 1
    registry.get("r2").in_flight = 3
    assert balancer.choose(None).name == "r1"


def test_anonymous_ties_rotate():
    _, balancer = make(3)
    assert Counter(balancer.choose(None).name for _ in range(30)) == {"r0": 10, "r1": 10, "r2": 10}


def test_bounded_load_skips_an_overloaded_home_replica():
    registry, balancer = make(3, algorithm="bounded_load", load_factor=1.25)
    home = balancer.choose("s")
    assert home.name == make(3)[1].choose("s").name  # same ranking as plain rendezvous when idle
    home.in_flight = 20
    assert balancer.choose("s") is not home
    home.in_flight = 0
    assert balancer.choose("s") is home


def test_registry_rejects_bad_changes():
    registry, _ = make(1)
    with pytest.raises(RegistryError, match="already exists"):
        registry.add("r0", "http://x:1")
    with pytest.raises(RegistryError, match="http"):
        registry.add("x", "x:1")
    with pytest.raises(RegistryError, match="weight"):
        registry.add("x", "http://x:1", 0)
    with pytest.raises(RegistryError, match="no replica"):
        registry.remove("nope")


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="balancer.algorithm"):
        Balancer(ReplicaRegistry(), BalancerSettings(algorithm="random"))


def test_sessions_on_places_a_session_on_the_replica_with_the_fewest_per_weight():
    registry = ReplicaRegistry()
    registry.add("r0", "http://127.0.0.1:8100")
    registry.add("r1", "http://127.0.0.1:8101", weight=2.0)
    registry.add("r2", "http://127.0.0.1:8102")
    balancer = Balancer(registry)
    counts = {"r0": 3, "r1": 5, "r2": 4}  # per unit of weight: 3, 2.5, 4
    on = lambda r: counts[r.name]  # noqa: E731
    assert {balancer.choose(f"s{i}", sessions_on=on).name for i in range(50)} == {"r1"}
    assert balancer.choose("s0", exclude=registry.get("r1"), sessions_on=on).name == "r0"
    # anonymous requests still go by in-flight load, whatever the counts
    registry.get("r0").in_flight = 1
    registry.get("r1").in_flight = 1
    assert balancer.choose(None, sessions_on=on).name == "r2"


def test_sessions_on_ties_go_to_the_sessions_rendezvous_choice():
    registry, balancer = make(4)
    even = lambda r: 7  # noqa: E731
    for i in range(100):
        assert balancer.choose(f"s{i}", sessions_on=even) is balancer.choose(f"s{i}")
    # the fewest among the tied: r3 is out, so each session goes to its first choice of the rest
    uneven = {"r0": 1, "r1": 1, "r2": 1, "r3": 2}
    for i in range(100):
        placed = balancer.choose(f"s{i}", sessions_on=lambda r: uneven[r.name])
        assert placed is balancer.choose(f"s{i}", exclude=registry.get("r3"))


def test_sessions_on_fills_replicas_evenly_as_counts_grow():
    registry, balancer = make(3)
    counts = Counter({r.name: 0 for r in registry.all()})
    for i in range(30):
        counts[balancer.choose(f"s{i}", sessions_on=lambda r: counts[r.name]).name] += 1
    assert set(counts.values()) == {10}
