"""The hit-rate bounds from the caches' block-seconds (`bench.cluster.cache_bound`): the
knapsack and the hull of TTLs by hand, what a run's records contribute, and no simulated run
beating its bound."""

from __future__ import annotations

import json
import random

import pytest

from kvgate.bench.cluster.cache_bound import (
    Window,
    decoding_token_seconds,
    kept_by_foresight,
    kept_without_foresight,
    ttl_points,
    upper_hull,
    windows_of,
)
from kvgate.bench.cluster.run import TurnRecord
from kvgate.cli import main


def _turn(session, number, start, end, ceiling, shared=0, ok=True, ttft=None, prompt=0):
    return TurnRecord(session, number, start, end, ttft, ok, 1, "r0", None, 0.0, prompt, 0, ceiling, shared)


def test_foresight_keeps_the_shortest_gaps_first_and_the_last_in_part():
    windows = [Window(100, 30.0), Window(100, 10.0), Window(100, 20.0)]
    # 10 s costs 1,000, 20 s 2,000: 3,000 spent, 1,000 left buys a third of the 30 s window
    assert kept_by_foresight(windows, 4000.0) == pytest.approx(100 + 100 + 100 / 3)
    assert kept_by_foresight(windows, 1e9) == 300
    assert kept_by_foresight(windows, 0.0) == 0


def test_one_ttl_for_every_window_pays_it_for_the_windows_it_loses():
    windows = [Window(100, 10.0), Window(100, 20.0), Window(100, 30.0)]
    # TTL 10 s: 3 x 1,000; 20 s: 1,000 + 2,000 for the kept, 2,000 for the 30 s window held and lost
    assert ttl_points(windows) == [(0.0, 0.0), (3000.0, 100.0), (5000.0, 200.0), (6000.0, 300.0)]


def test_without_foresight_the_best_mix_of_ttls_is_the_hull_of_the_single_ttls():
    windows = [Window(100, 10.0), Window(100, 10.0), Window(100, 10.0), Window(100, 1000.0)]
    # one TTL for all: under 10 s hits nothing, 10 s costs 4,000 (the long window held 10 s and lost)
    points = ttl_points(windows)
    assert (4000.0, 300.0) in points and max(kept for spent, kept in points if spent < 4000) == 0
    # 2,000 token-seconds: half the windows kept 10 s, the others not at all, hit half of 300
    assert kept_without_foresight(windows, 2000.0) == pytest.approx(150.0)
    assert kept_without_foresight(windows, 4000.0) == pytest.approx(300.0)
    # past the long window's gap everything is kept; foresight gets more for less
    assert kept_without_foresight(windows, 1e9) == 400
    assert kept_by_foresight(windows, 2000.0) == pytest.approx(200.0)
    # a point under the chord of its neighbours leaves the hull
    assert upper_hull([(0.0, 0.0), (1.0, 0.2), (2.0, 1.0), (3.0, 1.1)]) == [(0.0, 0.0), (2.0, 1.0), (3.0, 1.1)]


def test_windows_of_no_gap_are_hit_for_nothing():
    windows = [Window(50, 0.0), Window(100, 10.0)]
    assert kept_without_foresight(windows, 0.0) == 50
    assert kept_without_foresight(windows, 500.0) == pytest.approx(50 + 100 * 500 / 1000)


@pytest.mark.parametrize("seed", range(20))
def test_the_hull_is_never_below_one_ttl_nor_above_foresight(seed):
    rng = random.Random(seed)
    windows = [Window(rng.randint(1, 400), rng.lognormvariate(3.0, 1.0)) for _ in range(60)]
    points = ttl_points(windows)
    for _ in range(30):
        budget = rng.uniform(0.0, points[-1][0] * 1.1)
        one_ttl = max(kept for spent, kept in points if spent <= budget)
        assert one_ttl - 1e-6 <= kept_without_foresight(windows, budget) <= kept_by_foresight(windows, budget) + 1e-6


def test_a_window_is_a_sessions_own_tokens_from_its_last_turns_end_to_its_next_start():
    turns = [
        _turn(0, 1, 0.0, 2.0, ceiling=32, shared=32),
        _turn(0, 2, 12.0, 14.0, ceiling=96, shared=32),
        _turn(0, 3, 40.0, 41.0, ceiling=160, shared=32),
        _turn(1, 1, 0.0, 1.0, ceiling=0),
        _turn(1, 2, 5.0, 6.0, ceiling=48, ok=False),  # failed: hit nothing, keeps nothing
        _turn(1, 3, 9.0, 10.0, ceiling=64),  # after a failed turn: no window to keep
    ]
    assert sorted(windows_of(turns), key=lambda w: w.gap_s) == [Window(64, 10.0), Window(128, 26.0)]


def test_decoding_turns_hold_their_own_prompt_from_the_first_token_to_the_end():
    turns = [
        _turn(0, 1, 0.0, 3.0, ceiling=0, shared=16, ttft=1.0, prompt=116),  # 100 own tokens for 2 s
        _turn(0, 2, 5.0, 6.0, ceiling=0, ttft=None, prompt=50),  # no first token: not counted
    ]
    assert decoding_token_seconds(turns) == pytest.approx(200.0)


@pytest.mark.parametrize("regime", ["thrash", "prefill-bound"])
def test_no_policy_in_a_simulated_run_beats_its_bounds(tmp_path, regime):
    """Neither the hit rate of its foresight bound nor the makespan of its makespan bound
    (`bench.cluster.makespan_bound`, tests/bench/test_makespan_bound.py): one run checks both."""
    assert main(["sim", "cluster", "--regime", regime, "--no-plots", "--jobs", "1", "--out", str(tmp_path)]) == 0
    policies = json.loads((tmp_path / "report.json").read_text())["policies"]
    for name, summary in policies.items():
        bound = summary["hit_rate_bound_of_ceiling"]
        assert bound["no_foresight"] <= bound["foresight"] <= 1.0, name
        assert summary["hit_rate_of_ceiling"] <= bound["foresight"], name
        least = summary["makespan_bound_s"]
        assert 0 < least["chain_s"] and 0 < least["work_s"] <= summary["makespan_s"], name
        assert least["chain_s"] <= summary["makespan_s"], name
    # every policy served the same turns: the same bound, under the run's table
    assert len({str(summary["makespan_bound_s"]) for summary in policies.values()}) == 1
    assert "Least makespan any policy could take on these replicas" in (tmp_path / "table.md").read_text()
