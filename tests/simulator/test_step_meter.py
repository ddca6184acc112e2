"""The simulated engine's self-measurement reported by GET /v1/kvgate/kv (hand-worked)."""

import pytest

from kvgate.simulator.step_meter import StepMeter


def test_step_meter_by_hand():
    meter = StepMeter(weight=0.5, horizon_sec=1e9)  # the share without decay: plain sums
    assert meter.reading() == {
        "prefill_tokens_per_sec": None,
        "decode_step_sec": None,
        "prefill_share": None,
        "busy_share": None,
    }  # nothing measured yet
    meter.observe(prefill_tokens=0, decode_seqs=4, seconds=0.010)  # decode step 10 ms
    meter.observe(prefill_tokens=1000, decode_seqs=2, seconds=0.060)  # prefill added 50 ms: 20,000 tokens/s
    meter.observe(prefill_tokens=0, decode_seqs=4, seconds=0.014)  # decode EWMA 12 ms
    meter.observe(prefill_tokens=500, decode_seqs=0, seconds=0.062)  # added 50 ms: 10,000/s -> EWMA 15,000
    meter.observe(prefill_tokens=0, decode_seqs=0, seconds=0.0)  # nothing: ignored
    # busy seconds .010 + .060 + .014 + .062 = .146, of which prefill added .050 + .050
    assert meter.reading() == {
        "prefill_tokens_per_sec": pytest.approx(15000.0),
        "decode_step_sec": pytest.approx(0.012),
        "prefill_share": pytest.approx(0.100 / 0.146),
        "busy_share": None,  # no step's end given, and no reading time
    }


def test_the_busy_share_is_the_steps_share_of_the_wall_time():
    meter = StepMeter(horizon_sec=1e9)  # no decay: plain sums
    meter.observe(prefill_tokens=100, decode_seqs=0, seconds=0.2, ended_at=10.2)  # the meter begins at 10.0
    meter.observe(prefill_tokens=0, decode_seqs=1, seconds=0.2, ended_at=10.6)  # idle 10.2-10.4
    assert meter.reading(now=10.6)["busy_share"] == pytest.approx(0.4 / 0.6)
    assert meter.reading(now=11.0)["busy_share"] == pytest.approx(0.4 / 1.0)  # idle since


def test_the_prefill_share_follows_the_last_seconds_of_work():
    meter = StepMeter(horizon_sec=1.0)
    meter.observe(prefill_tokens=0, decode_seqs=1, seconds=0.01)
    meter.observe(prefill_tokens=2000, decode_seqs=1, seconds=1.01)  # 1 s of prefill
    for _ in range(10):
        meter.observe(prefill_tokens=0, decode_seqs=1, seconds=0.01)  # 0.1 s of decode steps
    share = meter.reading()["prefill_share"]
    assert 0.85 < share < 0.95  # ten short steps barely move it
    for _ in range(300):
        meter.observe(prefill_tokens=0, decode_seqs=1, seconds=0.01)  # 3 more seconds of decode
    assert meter.reading()["prefill_share"] < 0.05


def test_a_steps_cpu_tier_loads_are_not_prefill_time():
    meter = StepMeter(weight=0.5, horizon_sec=1e9)
    meter.observe(prefill_tokens=0, decode_seqs=4, seconds=0.010)  # decode step 10 ms
    # 1,000 prompt tokens and 40 ms of loads in a 100 ms step: prefill added 50 ms, 20,000 tokens/s
    meter.observe(prefill_tokens=1000, decode_seqs=2, seconds=0.100, load_seconds=0.040)
    reading = meter.reading()
    assert reading["prefill_tokens_per_sec"] == pytest.approx(20000.0)
    assert reading["prefill_share"] == pytest.approx(0.050 / 0.110)
