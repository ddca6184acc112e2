"""The admission experiment: the mechanism, determinism, rejection, shadow, and its CLI."""

import json

import pytest

from kvgate.cli import main
from kvgate.simulator.config import ConfigError
from kvgate.simulator.experiment import ExperimentConfig, run_experiment
from kvgate.simulator.percentiles import percentile
from kvgate.simulator.workload import WorkloadParams, generate_workload

SMALL = ExperimentConfig(workload=WorkloadParams(num_requests=300, oversize_every=100))


@pytest.fixture(scope="module")
def small_results():
    return run_experiment(SMALL, shadow=True)


def test_naive_preempts_and_recomputes_most_and_watermark_least(small_results):
    policies = small_results[0]["policies"]
    naive, reserve, watermark = policies["naive"], policies["reserve"], policies["reserve_watermark"]
    assert naive["preemptions"] > 2 * reserve["preemptions"] > 0
    assert naive["recomputed_tokens"] > reserve["recomputed_tokens"] > watermark["recomputed_tokens"]
    assert watermark["preemptions"] <= reserve["preemptions"]
    assert naive["watermark_violation_steps"] > watermark["watermark_violation_steps"]
    for summary in policies.values():
        assert summary["all_completed"] and summary["completed"] == 297 and summary["rejected"] == 3


def test_metrics_have_every_field_of_the_spec(small_results):
    summary = small_results[0]["policies"]["naive"]
    for key in (
        "completed",
        "preemptions",
        "recomputed_tokens",
        "recomputed_tokens_per_completed_request",
        "rejected",
        "ttft_p50_steps",
        "ttft_p95_steps",
        "e2e_p50_steps",
        "e2e_p95_steps",
        "throughput_requests_per_step",
        "sequence_slot_utilisation",
        "token_budget_utilisation",
        "watermark_violation_steps",
    ):
        assert key in summary
    assert set(summary["by_prompt_length"]) == {"<512", "512-2047", ">=2048"}
    assert sum(b["count"] for b in summary["by_prompt_length"].values()) == summary["completed"]
    assert summary["ttft_p50_steps"] <= summary["ttft_p95_steps"] <= summary["e2e_p95_steps"]
    assert 0 < summary["sequence_slot_utilisation"] <= 1 and 0 < summary["token_budget_utilisation"] <= 1


def test_shadow_reports_disagreements_on_the_naive_run_only(small_results):
    policies = small_results[0]["policies"]
    shadow = policies["naive"]["shadow"]
    assert shadow["decisions"] > 0 and 0 < shadow["disagreements"] <= shadow["decisions"]
    assert "shadow" not in policies["reserve"]
    with pytest.raises(ConfigError, match="naive"):
        run_experiment(SMALL, ("reserve",), shadow=True)


def test_timeline_is_per_step_and_consistent(small_results):
    run = small_results[1]["naive"]
    assert [row[0] for row in run.timeline] == list(range(len(run.timeline)))
    assert sum(row[7] for row in run.timeline) == run.counters.num_preemptions
    assert all(row[3] + row[4] == SMALL.engine.num_blocks for row in run.timeline)


def test_same_seed_same_workload_other_seed_other_workload():
    params = WorkloadParams(num_requests=50)
    assert generate_workload(params, 1, 16384) == generate_workload(params, 1, 16384)
    assert generate_workload(params, 1, 16384) != generate_workload(params, 2, 16384)
    arrivals = [r.arrival_step for r in generate_workload(params, 1, 16384)]
    assert arrivals == sorted(arrivals)


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 95) == 4


def run_cli(*args):
    return main(["sim", "admission", *args])


def test_cli_writes_byte_identical_outputs_for_the_same_seed(tmp_path, capsys):
    args = ("--num-requests", "150", "--no-plots", "--shadow")
    assert run_cli(*args, "--out", str(tmp_path / "a")) == 0
    assert run_cli(*args, "--out", str(tmp_path / "b")) == 0
    table = capsys.readouterr().out
    assert "reserve_watermark" in table and "shadow:" in table
    names = ["metrics.json", "timeline_naive.csv", "timeline_reserve.csv", "timeline_reserve_watermark.csv"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert set(metrics["policies"]) == {"naive", "reserve", "reserve_watermark"}
    header = (tmp_path / "a" / "timeline_naive.csv").read_text().splitlines()[0]
    assert (
        header == "step,waiting,running,free_blocks,used_blocks,obligation_tokens,admitted,preemptions,"
        "recomputed_tokens,scheduled_tokens"
    )


def test_cli_single_policy_with_plots(tmp_path):
    pytest.importorskip("matplotlib")
    assert run_cli("--policy", "reserve", "--num-requests", "60", "--out", str(tmp_path)) == 0
    assert (tmp_path / "timeline_reserve.png").stat().st_size > 0
    assert not (tmp_path / "timeline_naive.csv").exists()


@pytest.mark.parametrize(
    "args, name",
    [
        (("--num-blocks", "0"), "num_blocks"),
        (("--max-num-batched-tokens", "0"), "max_num_batched_tokens"),
        (("--prompt-len-min", "-5"), "prompt_len_min"),
        (("--output-len-max", "3", "--output-len-min", "4"), "output_len_max"),
        (("--arrival-rate", "0"), "arrival_rate"),
        (("--headroom-fraction", "1.5"), "headroom_fraction"),
        (("--policy", "reserve", "--shadow"), "--shadow"),
    ],
)
def test_cli_invalid_parameters_exit_2_naming_the_parameter(tmp_path, capsys, args, name):
    assert run_cli(*args, "--out", str(tmp_path)) == 2
    assert name in capsys.readouterr().err
    assert not (tmp_path / "metrics.json").exists()


def test_replica_cli_rejects_invalid_engine_parameters(capsys):
    assert main(["replica", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert main(["replica", "--num-blocks", "4", "--max-model-len", "1000"]) == 2
    assert "max_model_len" in capsys.readouterr().err
