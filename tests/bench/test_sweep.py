"""The sweep's grid and its choice of the best settings."""

import pytest

from kvgate.bench.agentic.sweep import best_point, grid_points, parse_values


def test_grid_is_the_full_product_in_stable_order():
    points = grid_points({"high_watermark": (0.7, 0.9), "hit_threshold": (0.5,), "idle_grace_sec": (1.0, 5.0)})
    assert points == [
        {"high_watermark": 0.7, "hit_threshold": 0.5, "idle_grace_sec": 1.0},
        {"high_watermark": 0.7, "hit_threshold": 0.5, "idle_grace_sec": 5.0},
        {"high_watermark": 0.9, "hit_threshold": 0.5, "idle_grace_sec": 1.0},
        {"high_watermark": 0.9, "hit_threshold": 0.5, "idle_grace_sec": 5.0},
    ]


def test_best_prefers_no_failures_then_makespan_then_hit_rate():
    rows = [
        {"settings": {"k": 1}, "makespan_s": 5.0, "hit_rate": 0.9, "failed": 2},
        {"settings": {"k": 2}, "makespan_s": 9.0, "hit_rate": 0.5, "failed": 0},
        {"settings": {"k": 3}, "makespan_s": 9.0, "hit_rate": 0.7, "failed": 0},
    ]
    best = best_point(rows)
    assert best["settings"] == {"k": 3} and not best["all_failed_some_turn"]
    flagged = best_point(rows[:1])
    assert flagged["settings"] == {"k": 1} and flagged["all_failed_some_turn"]
    assert best_point([]) is None


def test_parse_values():
    assert parse_values("0.7, 0.9", "high_watermark") == (0.7, 0.9)
    assert parse_values("0,32", "headroom_blocks") == (0, 32)
    assert all(isinstance(v, int) for v in parse_values("0,32", "headroom_blocks"))
    with pytest.raises(ValueError, match="--sweep-high-watermark"):
        parse_values("a,b", "high_watermark")
