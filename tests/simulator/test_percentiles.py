"""The one percentile definition (nearest rank) every report uses."""

from __future__ import annotations

import math

import pytest

from kvgate.simulator.percentiles import percentile


@pytest.mark.parametrize(
    "values, pct, expected",
    [
        ([1, 2, 3, 4], 50, 2),
        ([1, 2, 3, 4], 51, 3),
        ([1, 2, 3, 4], 95, 4),
        ([1, 2, 3, 4], 100, 4),
        ([4, 1, 3, 2], 25, 1),  # any order
        ([3.0], 95, 3.0),
        (range(1, 21), 95, 19),  # 20 values: the p95 is the slowest but one
        (range(1, 101), 99, 99),
    ],
)
def test_nearest_rank(values, pct, expected):
    assert percentile(values, pct) == expected


def test_no_values_give_the_empty_value():
    assert percentile([], 50) is None
    assert math.isnan(percentile([], 50, math.nan))
