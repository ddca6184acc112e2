"""run_vllm_bench.py's server for each real-vLLM regime (pure: no server is started)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_harness import model_cache_dir

from kvgate.bench.agentic.regimes import REGIMES

SCRIPT = Path(__file__).resolve().parent / "scripts" / "run_vllm_bench.py"
spec = importlib.util.spec_from_file_location("run_vllm_bench", SCRIPT)
run_vllm_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_vllm_bench)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_real_vllm_regime_names_a_model_and_only_those_are_offered():
    assert run_vllm_bench.VLLM_REGIMES == [
        "vllm-prefill",
        "vllm-prefill-capped",
        "vllm-prefill-no-finish",
        "vllm-small",
        "vllm-small-no-finish",
    ]
    assert {REGIMES[name].vllm_model for name in run_vllm_bench.VLLM_REGIMES} == {"tiny", "prefill"}
    assert REGIMES["vllm-prefill"].workload.send_finish and not REGIMES["vllm-prefill-no-finish"].workload.send_finish
    assert REGIMES["vllm-small"].workload.send_finish and not REGIMES["vllm-small-no-finish"].workload.send_finish
    capped = REGIMES["vllm-prefill-capped"].workload  # a cap, and stop strings where the random model's text ends
    assert capped.max_tokens and capped.stop and capped.max_tokens > capped.reply_tokens


@pytest.mark.parametrize("regime", ["vllm-small", "vllm-prefill-no-finish"])
def test_the_server_matches_the_regimes_cache_shape(regime, tmp_path):
    shape = REGIMES[regime].shape
    server = run_vllm_bench.server_for(regime, Path("/venv/bin/python"), tmp_path / "model", tmp_path / "vllm.log")
    command = server.command()
    # num_blocks usable + vLLM's null block; the longest prompt fits the usable blocks
    assert int(flag(command, "--num-gpu-blocks-override")) == shape.num_blocks + 1
    assert int(flag(command, "--block-size")) == shape.block_size
    assert int(flag(command, "--max-model-len")) == shape.max_model_len == shape.num_blocks * shape.block_size
    assert int(flag(command, "--max-num-seqs")) == shape.max_num_seqs
    assert flag(command, "--served-model-name") == REGIMES[regime].vllm_model
    assert int(flag(command, "--max-num-batched-tokens")) == shape.max_num_batched_tokens
    assert "--enable-prompt-tokens-details" in command


def test_the_server_loads_the_retention_connector_unless_told_not_to(tmp_path):
    args = (Path("/venv/bin/python"), tmp_path / "model", tmp_path / "vllm.log")
    kept = run_vllm_bench.server_for("vllm-prefill-no-finish", *args).command()
    assert flag(kept, "--kv-transfer-config") == run_vllm_bench.CONNECTOR_CONFIG
    assert "KvgateRetentionConnector" in flag(kept, "--kv-transfer-config")
    assert "--kv-transfer-config" not in run_vllm_bench.server_for("vllm-small", *args, retention=False).command()


def test_each_preset_has_its_own_cache_directory():
    assert model_cache_dir("tiny") != model_cache_dir("prefill")
    assert model_cache_dir("tiny") == model_cache_dir("tiny")


def test_a_pinned_server_binds_vllms_openmp_threads_to_the_engine_cpus_and_unpinned_binds_none(tmp_path):
    split = run_vllm_bench.plan_split({0, 1, 2, 3})
    pinned = run_vllm_bench.server_for("vllm-small", Path("/venv/bin/python"), tmp_path, tmp_path / "log", split)
    assert pinned.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    unpinned = run_vllm_bench.server_for("vllm-small", Path("/venv/bin/python"), tmp_path, tmp_path / "log")
    assert unpinned.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_both_pinnings_run_pinned_first_each_into_its_own_folder():
    out = Path("results/x")
    assert run_vllm_bench.runs_of("both", out) == [("pinned", out / "pinned"), ("unpinned", out / "unpinned")]
    assert run_vllm_bench.runs_of("pinned", out) == [("pinned", out)]
    assert run_vllm_bench.runs_of("unpinned", out) == [("unpinned", out)]


@pytest.mark.parametrize("pinning", ["pinned", "both"])
def test_on_one_cpu_the_runner_refuses_pinned_mode_before_starting_anything(pinning, tmp_path):
    """Run on one CPU: exit 2 with the reason and what to run instead; no venv is looked for."""
    first = min(os.sched_getaffinity(0))
    env = {**os.environ, "KVGATE_VLLM_VENV": str(tmp_path / "no-venv")}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--regime", "vllm-small", "--pinning", pinning, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, {first}),
    )
    assert result.returncode == 2, result.stderr
    assert "pinned mode needs at least 2 CPUs" in result.stderr and "--pinning unpinned" in result.stderr
    assert not (tmp_path / "no-venv").exists() and not (tmp_path / "out").exists()
