"""Cost presets: the published fit as given, and coarsening keeps the real run's ratios."""

import pytest

from kvgate.simulator.config import EngineConfig
from kvgate.simulator.cost_presets import COST_PRESETS, get_cost_preset


def test_the_8b_h100_fit():
    preset = get_cost_preset("h100-8b")
    engine, cost = preset.scaled(1)
    assert cost.step_seconds(0, 0, 0) == pytest.approx(0.00575)
    assert cost.step_seconds(1000, 10, 0) == pytest.approx(0.00575 + 1000 * 17.25e-6 + 10 * 6e-6)
    assert engine.cache_tokens == pytest.approx(467_000, abs=engine.block_size)


def test_the_70b_preset_is_dearer_with_a_smaller_cache():
    small, large = get_cost_preset("h100-8b"), get_cost_preset("h100x2-70b")
    assert large.cost.prefill_token_s > 3 * small.cost.prefill_token_s
    assert large.cost.step_overhead_s > small.cost.step_overhead_s
    assert large.kv_tokens < small.kv_tokens


@pytest.mark.parametrize("name", sorted(COST_PRESETS))
@pytest.mark.parametrize("factor", [2, 8, 16])
def test_scaling_keeps_times_and_the_context_to_cache_ratio(name, factor):
    preset = get_cost_preset(name)
    (engine, cost), (scaled_engine, scaled_cost) = preset.scaled(1), preset.scaled(factor)
    # 32 steps of a batch of 64 sequences, the first prefilling 4,000 tokens, take as long as
    # 32/f steps of the coarsened engine, the first prefilling 4,000/f tokens
    real = cost.step_seconds(4000, 64, 0) + 31 * cost.step_seconds(0, 64, 0)
    coarse = scaled_cost.step_seconds(4000 / factor, 64, 0) + (32 / factor - 1) * scaled_cost.step_seconds(0, 64, 0)
    assert coarse == pytest.approx(real)
    assert scaled_engine.cache_tokens * factor == pytest.approx(engine.cache_tokens, rel=0.01)
    assert scaled_engine.max_num_seqs == engine.max_num_seqs
    assert scaled_engine.max_num_batched_tokens > scaled_engine.max_num_seqs
    assert isinstance(scaled_engine.validate(), EngineConfig)


def test_unknown_preset_and_bad_factor_say_what_to_do():
    with pytest.raises(ValueError, match="h100-8b"):
        get_cost_preset("a100")
    with pytest.raises(ValueError, match=">= 1"):
        get_cost_preset("h100-8b").scaled(0.5)
