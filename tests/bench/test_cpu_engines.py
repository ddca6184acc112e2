"""A real-vLLM regime's simulation stands for its CPU server as measured (bench/agentic/cpu_engines.py)."""

from __future__ import annotations

import json

import pytest

from kvgate.bench.agentic.cpu_engines import CpuEngine, measured_engine, simulated_prompt_tokens
from kvgate.bench.agentic.regimes import REGIMES
from kvgate.bench.agentic.workload import generate_workload
from kvgate.cli import main

PREFILL = REGIMES["vllm-prefill-no-finish"]


def _sticky_report(out) -> dict:
    """Sticky's summary in the regime's cluster simulation (`kvgate sim cluster`)."""
    options = ["--regime", PREFILL.name, "--policies", "sticky", "--no-plots", "--out", str(out)]
    assert main(["sim", "cluster", *options]) == 0
    return json.loads((out / "report.json").read_text())["policies"]["sticky"]


def test_the_simulated_replica_holds_the_servers_cache_in_simulated_tokens():
    engine = CpuEngine(step_overhead_s=0.009, token_s=0.0003, tokens_per_sim_token=3.6)
    server = PREFILL.shape  # 63 blocks of 32 tokens, 512 tokens a step, 2016-token contexts
    simulated = engine.simulated(server)
    assert (simulated.num_blocks, simulated.block_size) == (63, 9)  # 32 / 3.6 tokens a block, as many blocks
    assert simulated.max_num_batched_tokens == 143 and simulated.max_model_len == 560
    assert simulated.max_num_seqs == server.max_num_seqs and simulated.time_scale == 1.0
    # a simulated prompt token stands for 3.6 of the server's; a decoding sequence for one
    assert simulated.prefill_token_s == pytest.approx(0.00108) and simulated.decode_seq_s == 0.0003
    assert (simulated.step_overhead_s, simulated.context_token_s) == (0.009, 0.0)


@pytest.mark.parametrize(
    "figures", [(-0.001, 0.0003, 3.6), (0.009, 0.0, 3.6), (0.009, 0.0003, 0.5)], ids=["overhead", "token", "scale"]
)
def test_a_cpu_engine_refuses_figures_no_server_has(figures):
    with pytest.raises(ValueError, match="a CPU engine needs"):
        CpuEngine(*figures)


def test_the_measurement_fits_the_steps_and_divides_the_prompt_tokens():
    steps = [(0.009 + 8 * 0.0003, 8)] * 30 + [(0.009 + 500 * 0.0003, 500)] * 10
    assert measured_engine(steps, 35_800, 10_000) == CpuEngine(0.009, 0.0003, 3.58)
    assert measured_engine(steps[:5], 35_800, 10_000) is None  # too few steps for a fit
    assert measured_engine(steps, 35_800, 0) is None


def test_simulated_prompt_tokens_are_the_tokens_a_simulation_of_the_regime_counts(tmp_path):
    """The ratio's denominator is what the regime's simulation prefills and hits in all."""
    workload = generate_workload(PREFILL.workload, 0)
    sticky = _sticky_report(tmp_path)
    counted = sticky["prompt_tokens_per_s"] * sticky["makespan_s"]  # both rounded in the report
    assert counted == pytest.approx(simulated_prompt_tokens(workload), abs=5)


def test_the_regimes_simulation_thrashes_as_its_server_does(tmp_path):
    """On the server, sticky routing hits about 0.1 of the prompt tokens (docs/results.md):
    six sessions' contexts need about twice its cache. Simulated with the GPU cost model and
    the simulator's one token a word, they fit, and sticky hit 0.66."""
    assert PREFILL.cpu_engine is not None and PREFILL.simulated_shape() != PREFILL.shape
    sticky = _sticky_report(tmp_path)
    assert sticky["hit_rate"] < 0.2
    assert 8 < sticky["makespan_s"] < 20  # the server's sticky rounds take 12-13 s
