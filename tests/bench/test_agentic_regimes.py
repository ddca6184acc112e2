"""Regime presets of `kvgate bench agentic`: a renamed regime is refused with its new name."""

from __future__ import annotations

import pytest

from kvgate.bench.agentic.regimes import REGIMES, RENAMED_REGIMES, get_regime
from kvgate.bench.results_page import ROWS


@pytest.mark.parametrize("old, new", sorted(RENAMED_REGIMES.items()))
def test_a_renamed_regime_is_refused_with_its_new_name(old, new):
    with pytest.raises(ValueError, match=f"now called '{new}'"):
        get_regime(old)
    assert get_regime(new).name == new and old not in REGIMES


def test_calm_is_two_sessions_at_once_with_room_for_both():
    calm, roomy = get_regime("calm"), get_regime("no-pressure")
    assert (calm.workload.sessions, calm.workload.concurrency) == (2, 2)
    assert calm.shape == roomy.shape and calm.gate == {}  # the gate's defaults


def test_every_simulated_regime_of_the_targets_has_a_results_row():
    rows = {row.regime for row in ROWS}
    for regime in ("calm", "silent-burst", "cheap-prefill", "thrash", "prefill-bound", "no-pressure-no-finish"):
        assert regime in rows
