"""`kvgate sim cluster --seeds`: policies over several workload draws, each against the
baseline on the same draw."""

from __future__ import annotations

import json

import pytest

from kvgate.bench.cluster.seed_sweep import baseline_of, format_seeds, parse_seeds, seed_ratios
from kvgate.cli import main


def test_seeds_are_a_comma_list_of_seeds_and_ranges_each_once():
    assert parse_seeds("0-2,5,1") == [0, 1, 2, 5]
    assert parse_seeds(" 7 , 3 ") == [7, 3]
    for bad, says in (("1", "two seeds or more"), ("a", "'a' is not a seed"), ("3-1", "empty range"), ("", "not")):
        with pytest.raises(ValueError, match=says):
            parse_seeds(bad)


def _summary(makespan: float, session_p95: float | None, turn_mean: float, hit: float) -> dict:
    return {
        "makespan_s": makespan,
        "session_completion_s": {"p95": session_p95},
        "turn_latency_s": {"mean": turn_mean},
        "hit_rate": hit,
    }


def test_each_policy_is_measured_against_the_baseline_on_the_same_seed():
    by_seed = {
        3: {"sticky": _summary(100, 50, 1.0, 0.2), "working_set": _summary(50, 40, 0.8, 0.6)},
        8: {"sticky": _summary(80, 40, 2.0, 0.3), "working_set": _summary(96, None, 2.2, 0.5)},
    }
    assert baseline_of(["working_set", "sticky"]) == "sticky"
    assert baseline_of(["working_set", "direct"]) == "working_set"
    ratios = seed_ratios(by_seed, "sticky")
    assert ratios["working_set"] == {"makespan": [0.5, 1.2], "session p95": [0.8, None], "turn mean": [0.8, 1.1]}
    assert ratios["sticky"]["makespan"] == [1.0, 1.0]
    table = format_seeds(by_seed, "sticky")
    assert table.startswith("Seeds 3, 8; every figure over sticky's on the same seed.")
    row = next(line for line in table.splitlines() if line.startswith("| working_set"))
    # mean and worst of the seeds that have the figure; a missing one shows as '-'
    assert row == (
        "| working_set | 0.850 / 1.20 (0.50 1.20) | 0.800 / 0.80 (0.80 -) | 0.950 / 1.10 (0.80 1.10) | 0.550 (0.500) |"
    )


def test_the_command_runs_every_policy_on_each_seed_as_a_run_of_that_seed(tmp_path, capsys):
    common = ["sim", "cluster", "--regime", "vllm-small", "--policies", "sticky,working_set", "--no-plots"]
    assert main([*common, "--seeds", "0-1", "--jobs", "1", "--out", str(tmp_path / "seeds")]) == 0
    printed = capsys.readouterr().out
    assert main([*common, "--seed", "1", "--out", str(tmp_path / "one")]) == 0
    seeds = tmp_path / "seeds"
    assert (seeds / "seed_1" / "report.json").read_bytes() == (tmp_path / "one" / "report.json").read_bytes()
    document = json.loads((seeds / "seeds.json").read_text())
    assert document["baseline"] == "sticky" and document["seeds"] == [0, 1]
    for index, seed in enumerate((0, 1)):
        policies = json.loads((seeds / f"seed_{seed}" / "report.json").read_text())["policies"]
        expected = round(policies["working_set"]["makespan_s"] / policies["sticky"]["makespan_s"], 4)
        assert document["ratios"]["working_set"]["makespan"][index] == expected
    assert (seeds / "seeds.md").read_text() in printed
    assert "[cluster] seed 1, 1 replicas, working_set:" in printed


@pytest.mark.parametrize(
    "options",
    [("--seeds", "0,1", "--seed", "2"), ("--seeds", "0,1", "--replicas", "1,2"), ("--seeds", "4")],
)
def test_seeds_refuse_a_second_sweep_a_single_seed_and_a_seed_beside_them(options, capsys):
    assert main(["sim", "cluster", "--regime", "vllm-small", *options]) == 2
    assert "--seeds" in capsys.readouterr().err
