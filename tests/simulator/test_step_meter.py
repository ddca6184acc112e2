"""The simulated engine's self-measurement reported by GET /v1/kvgate/kv (hand-worked)."""

import pytest

from simulator.step_meter import StepMeter


def test_step_meter_by_hand():
    meter = StepMeter(weight=0.5)
    assert meter.reading() == {"prefill_tokens_per_sec": None, "decode_step_sec": None,
                               "prefill_share": None}  # nothing measured yet
    meter.observe(prefill_tokens=0, decode_seqs=4, seconds=0.010)     # decode step 10 ms
    meter.observe(prefill_tokens=1000, decode_seqs=2, seconds=0.060)  # prefill added 50 ms: 20,000 tokens/s
    meter.observe(prefill_tokens=0, decode_seqs=4, seconds=0.014)     # decode EWMA 12 ms
    meter.observe(prefill_tokens=500, decode_seqs=0, seconds=0.062)   # added 50 ms: 10,000/s -> EWMA 15,000
    meter.observe(prefill_tokens=0, decode_seqs=0, seconds=0.0)       # nothing: ignored
    # busy seconds decayed by half each step: ((.010*.5 + .060)*.5 + .014)*.5 + .062 = 0.08525;
    # prefill's part: (.050*.5*.5) + .050 = 0.0625
    assert meter.reading() == {"prefill_tokens_per_sec": pytest.approx(15000.0),
                               "decode_step_sec": pytest.approx(0.012),
                               "prefill_share": pytest.approx(0.0625 / 0.08525)}
