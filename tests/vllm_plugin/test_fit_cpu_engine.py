"""fit_cpu_engine.py measures a real-vLLM regime's server as its simulation stands for it.

It runs the tiny model's regime once with the plugin's step log on, and the figures it
prints are those the regime declares (`Regime.cpu_engine`): the tokens per simulated token
exactly (the models' BPE and chat template against the simulator's, on the same
workload), the step costs within a factor of three (timings on a shared machine: this
catches a step log that records nothing useful or a regime measured on another model,
not drift).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_harness import REPO_ROOT

from kvgate.bench.agentic.cpu_engines import CpuEngine
from kvgate.bench.agentic.regimes import REGIMES

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a pinned run needs 2 CPUs"),
]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fit_cpu_engine.py"
REGIME = "vllm-small-no-finish"


def test_the_fit_reproduces_the_regimes_declared_engine(vllm_python, tiny_model, tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--regime", REGIME, "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = CpuEngine(**json.loads((tmp_path / "cpu_engine.json").read_text()))
    assert f"measured: {measured}" in done.stdout
    declared = REGIMES[REGIME].cpu_engine
    assert declared is not None and f"declared: {declared}" in done.stdout
    assert measured.tokens_per_sim_token == pytest.approx(declared.tokens_per_sim_token, abs=0.02)
    for name in ("step_overhead_s", "token_s"):
        assert 1 / 3 < getattr(measured, name) / getattr(declared, name) < 3, (name, measured, declared)
    lines = (tmp_path / "steps.txt").read_text().splitlines()
    assert len(lines) > 100 and all(len(line.split()) == 2 for line in lines)
