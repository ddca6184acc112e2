"""The simulated engine's self-measurement reported by GET /v1/kvgate/kv (hand-worked)."""

import pytest

from simulator.step_meter import StepMeter


def test_step_meter_smooths_prefill_throughput_and_decode_step_time():
    meter = StepMeter(weight=0.5)
    assert meter.reading() == {"prefill_tokens_per_sec": None, "decode_step_sec": None,
                               "prefill_share": None}  # nothing measured yet
    meter.observe(prefill_tokens=1000, decode_seqs=2, seconds=0.05)   # 20,000 tokens/s
    meter.observe(prefill_tokens=0, decode_seqs=4, seconds=0.008)     # a decode-only step
    meter.observe(prefill_tokens=500, decode_seqs=0, seconds=0.05)    # 10,000 tokens/s -> EWMA 15,000
    meter.observe(prefill_tokens=0, decode_seqs=4, seconds=0.012)     # -> EWMA 0.010
    meter.observe(prefill_tokens=0, decode_seqs=0, seconds=0.0)       # nothing: ignored
    # busy time, decayed by half a step: ((0.05 * .5 + .008) * .5 + .05) * .5 + .012 = 0.04525;
    # prefill steps' part: (0.05 * .25 + 0.05) * .5 = 0.03125
    assert meter.reading() == {"prefill_tokens_per_sec": pytest.approx(15000.0), "decode_step_sec": pytest.approx(0.010),
                               "prefill_share": pytest.approx(0.03125 / 0.04525)}
