"""CounterHistory (proxy/status_history.py): per-interval differences of cumulative counters."""

from __future__ import annotations

import pytest

from kvgate.proxy.status_history import CounterHistory, ReplicaCounters


def test_differences_per_interval_with_a_reset_and_a_missing_replica():
    history = CounterHistory(size=5)
    history.record(0.0, {"r0": ReplicaCounters(10, 20, {"open": 1})})
    history.record(5.0, {"r0": ReplicaCounters(40, 60, {"open": 4, "holds_window": 2})})
    history.record(10.0, {"r0": ReplicaCounters(3, 4, {"open": 4, "holds_window": 3})})  # the replica restarted
    history.record(15.0, {})  # the replica was not there
    series = history.series()
    assert series["t"] == [5.0, 10.0, 15.0]
    r0 = series["replicas"]["r0"]
    assert r0["hit_rate"] == [0.75, 0.75, None]
    assert r0["admissions"] == {"holds_window": [2, 1, None], "open": [3, 0, None]}


def test_old_samples_fall_off_and_the_recent_hit_rate_sums_intervals():
    history = CounterHistory(size=3)
    for t, (hits, queries) in enumerate([(0, 0), (0, 100), (50, 200), (150, 300)]):
        history.record(float(t), {"r0": ReplicaCounters(hits, queries)})
    assert history.series()["t"] == [2.0, 3.0]
    assert history.recent_hit_rate("r0", intervals=2) == 0.75
    assert history.recent_hit_rate("r1") is None
    history.record(4.0, {"r0": ReplicaCounters(None, 300)})  # a failed read: no counters
    assert history.series()["replicas"]["r0"]["hit_rate"][-1] is None


def test_a_history_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        CounterHistory(size=1)
