"""run_vllm_bench.py's server for each real-vLLM regime (pure: no server is started)."""

from __future__ import annotations

import importlib.util
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
        "vllm-prefill-no-finish",
        "vllm-small",
        "vllm-small-no-finish",
    ]
    assert {REGIMES[name].vllm_model for name in run_vllm_bench.VLLM_REGIMES} == {"tiny", "prefill"}
    assert REGIMES["vllm-prefill"].workload.send_finish and not REGIMES["vllm-prefill-no-finish"].workload.send_finish
    assert REGIMES["vllm-small"].workload.send_finish and not REGIMES["vllm-small-no-finish"].workload.send_finish


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


def test_each_preset_has_its_own_cache_directory():
    assert model_cache_dir("tiny") != model_cache_dir("prefill")
    assert model_cache_dir("tiny") == model_cache_dir("tiny")
