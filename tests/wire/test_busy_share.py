"""The busy share a probe-API server reports (`kvgate.wire.busy_share`), worked by hand."""

import math

import pytest

from kvgate.wire.busy_share import BusyMeter


def test_no_step_no_measurement():
    assert BusyMeter().share(5.0) is None


def test_without_decay_it_is_step_seconds_over_wall_seconds():
    meter = BusyMeter(horizon_sec=1e9)
    meter.observe(ended_at=1.0, seconds=1.0)  # began at 0
    meter.observe(ended_at=3.0, seconds=0.5)  # idle 1.0-2.5
    assert meter.share(3.0) == pytest.approx(1.5 / 3.0)
    assert meter.share(6.0) == pytest.approx(1.5 / 6.0)


def test_an_engine_stepping_back_to_back_is_fully_busy():
    meter = BusyMeter(horizon_sec=2.0)
    for i in range(1, 1001):
        meter.observe(ended_at=i * 0.01, seconds=0.01)
    assert meter.share(10.0) == pytest.approx(1.0)


def test_it_follows_the_last_seconds():
    meter = BusyMeter(horizon_sec=1.0)
    for i in range(1, 501):  # 5 s busy, then 3 s idle
        meter.observe(ended_at=i * 0.01, seconds=0.01)
    busy = meter.share(8.0)
    assert busy == pytest.approx(math.exp(-3.0) * (1 - math.exp(-5.0)) / (1 - math.exp(-8.0)), rel=1e-2)
    assert busy < 0.06


def test_half_busy_reads_half():
    meter = BusyMeter(horizon_sec=2.0)
    for i in range(1, 1001):  # a 10 ms step every 20 ms
        meter.observe(ended_at=i * 0.02, seconds=0.01)
    assert meter.share(20.0) == pytest.approx(0.5, abs=0.01)


def test_the_share_never_exceeds_one():
    meter = BusyMeter(horizon_sec=1.0)
    meter.observe(ended_at=1.0, seconds=1.0)
    meter.observe(ended_at=1.0, seconds=1.0)  # an overlapping report
    assert meter.share(1.0) == 1.0


def test_a_long_step_weighs_each_of_its_seconds_by_its_age():
    meter = BusyMeter(horizon_sec=2.0)
    meter.observe(ended_at=2.0, seconds=2.0)  # busy 0-2, then idle until 4
    busy = math.exp(-1.0) - math.exp(-2.0)  # the integral of exp(-(4 - u) / 2) / 2 over 0 <= u <= 2
    wall = 1.0 - math.exp(-2.0)  # the same over 0 <= u <= 4
    assert meter.share(4.0) == pytest.approx(busy / wall)  # 0.27 (counted at its end it read 0.43)
    assert meter.started and not BusyMeter().started
