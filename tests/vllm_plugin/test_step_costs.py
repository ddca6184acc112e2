"""The plugin's marginal token cost, fitted from the engine's steps (pure; no vLLM needed)."""

import pytest

from kvgate.vllm_plugin.engine_rates import prefill_rate
from kvgate.vllm_plugin.step_costs import MAX_STEPS, STEP_LOG_ENV, StepLog, marginal_token_sec, step_sink_from_env
from kvgate.wire.probe_api import KvAnswer, merge_kv
from kvgate.wire.step_fit import MIN_STEPS, fit_step_seconds


def test_the_fit_by_hand():
    """Steps of 20 ms overhead + 10 us a token: decode steps of 8 tokens (20.08 ms) and
    steps carrying a 1,500-token prefill (35.08 ms): 10 us a token, 100,000 tokens/s,
    whatever the mix."""
    steps = [(0.02 + 8e-5, 8)] * 30 + [(0.02 + 0.015 + 8e-5, 1508)] * 10
    assert marginal_token_sec(steps) == pytest.approx(1e-5)
    assert prefill_rate(2000.0, marginal_token_sec(steps)) == pytest.approx(100000.0)


@pytest.mark.parametrize(
    "steps",
    [
        [(0.02, 8), (0.035, 1508)] * (MIN_STEPS // 2 - 1),  # too few steps
        [(0.02, 8), (0.03, 60)] * MIN_STEPS,  # a token spread below MIN_TOKEN_SPREAD
        [(0.03, 8), (0.02, 1508)] * MIN_STEPS,  # larger steps ran faster: noise, no figure
    ],
)
def test_no_figure(steps):
    assert marginal_token_sec(steps) is None


def test_the_fit_gives_the_steps_overhead_too():
    steps = [(0.02 + 8e-5, 8)] * 30 + [(0.02 + 0.015 + 8e-5, 1508)] * 10
    overhead, token_sec = fit_step_seconds(steps)
    assert overhead == pytest.approx(0.02) and token_sec == pytest.approx(1e-5)
    assert fit_step_seconds(steps[: MIN_STEPS - 1]) is None


def test_a_step_log_with_a_sink_writes_each_step_it_keeps(tmp_path, monkeypatch):
    path = tmp_path / "steps.txt"
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    assert step_sink_from_env() is None
    monkeypatch.setenv(STEP_LOG_ENV, str(path))
    sink = step_sink_from_env()
    log = StepLog(sink=sink)
    log.record(0.01, 0)  # nothing scheduled: neither kept nor written
    log.record(0.0125, 8, ended_at=1.0)
    log.record(0.5, 1500)
    sink.close()
    assert path.read_text().splitlines() == ["0.012500 8", "0.500000 1500"]


def test_without_a_fit_the_counters_figure_stands():
    assert prefill_rate(2000.0, None) == 2000.0
    assert prefill_rate(None, None) is None


def test_the_step_log_keeps_the_most_recent_non_empty_steps():
    log = StepLog()
    log.record(0.01, 0)  # nothing scheduled: not a step that computed anything
    for i in range(MAX_STEPS + 10):
        log.record(0.02, i + 1)
    assert len(log.steps) == MAX_STEPS and log.steps[0] == (0.02, 11)


def test_merge_reports_the_slowest_engines_token_cost():
    def engine(token_sec):
        return KvAnswer.of_engine(
            num_gpu_blocks=65,
            num_free_blocks=64,
            num_cached_blocks=0,
            block_size=16,
            num_running=0,
            num_waiting=0,
            token_sec=token_sec,
        )

    assert merge_kv([engine(1e-5), engine(None), engine(3e-5)]).token_sec == 3e-5
    assert merge_kv([engine(None)]).token_sec is None


def test_the_step_log_measures_the_busy_share_from_its_steps_ends():
    log = StepLog()
    assert log.busy.share(1.0) is None
    log.record(0.01, 0, ended_at=0.5)  # nothing scheduled: not counted
    assert log.busy.share(1.0) is None
    for i in range(1, 1001):  # a 10 ms step every 40 ms for 40 s
        log.record(0.01, 8, ended_at=i * 0.04)
    assert log.busy.share(40.0) == pytest.approx(0.25, abs=0.01)
    log.record(0.02, 8)  # no end given: fitted, not counted in the share
    assert log.steps[-1] == (0.02, 8) and log.busy.share(40.0) == pytest.approx(0.25, abs=0.01)
