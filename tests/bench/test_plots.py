"""The hit-rate-over-time series and the PNG plots."""

import pytest

from kvgate.bench.agentic.plots import windowed_hit_rate, write_plots


def test_windowed_hit_rate_from_cumulative_samples():
    timeline = [
        {"t": 1.0, "queries": 100, "hits": 50},
        {"t": 2.0, "queries": 100, "hits": 50},
        {"t": 3.0, "queries": 300, "hits": 200},
    ]
    assert windowed_hit_rate(timeline) == [(1.0, 0.5), (3.0, 0.75)]  # the empty interval is skipped


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the plots extra) is not installed")
    results = {"sticky": {"ceiling_hit_rate": 0.9, "turn_latency_mean_s_by_turn": {"1": 0.5, "2": 0.7}}}
    timelines = {"sticky": [{"t": 1.0, "queries": 10, "hits": 5}]}
    names = write_plots(results, timelines, tmp_path)
    assert names == ["hit_rate_over_time.png", "turn_latency_by_turn.png"]
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
