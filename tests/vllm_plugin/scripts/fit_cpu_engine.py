"""Measure a real-vLLM regime's CPU server for the simulation that stands for it.

    .venv/bin/python tests/vllm_plugin/scripts/fit_cpu_engine.py --regime vllm-prefill-no-finish [--out DIR]

Runs the regime's sticky benchmark once on its vLLM CPU server, pinned as the results
page's row is (`run_vllm_bench.py --pinning pinned --modes sticky`), with the plugin's step
log on (`KVGATE_STEP_LOG`: every scheduler step's seconds and scheduled tokens). Then it
fits the steps (step seconds = overhead + seconds per token x tokens) and sets the
server's prompt tokens (the benchmark's `prompt_tokens_queried`) against the simulator's
for the same workload, and prints the `CpuEngine` they make beside the one the regime
declares (bench/agentic/regimes.py, `Regime.cpu_engine`), with how far each figure is
from it, and writes it to `cpu_engine.json` in the output folder. Paste the measured one
there to recalibrate the regime's simulations.

Exit status: 0 measured, 1 the benchmark failed or its steps gave no fit, 2 bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_vllm_bench, beside this script
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo

import run_vllm_bench  # noqa: E402

from kvgate.bench.agentic.cpu_engines import CpuEngine, measured_engine, simulated_prompt_tokens  # noqa: E402
from kvgate.bench.agentic.regimes import REGIMES  # noqa: E402
from kvgate.bench.agentic.workload import generate_workload  # noqa: E402
from kvgate.vllm_plugin.step_costs import STEP_LOG_ENV  # noqa: E402

SEED = 0  # the benchmark's default seed: the workload the results page runs


def read_steps(path: Path) -> list[tuple[float, int]]:
    """The step log's `seconds tokens` lines."""
    steps = []
    for line in path.read_text().splitlines():
        seconds, tokens = line.split()
        steps.append((float(seconds), int(tokens)))
    return steps


def compare(declared: CpuEngine | None, measured: CpuEngine) -> str:
    """The measured engine, and each figure against the declared one."""
    lines = [f"measured: {measured}"]
    if declared is None:
        return "\n".join(lines + ["declared: none (the regime's simulations use its shape as it is)"])
    lines.append(f"declared: {declared}")
    for name in ("step_overhead_s", "token_s", "tokens_per_sim_token"):
        was, now = getattr(declared, name), getattr(measured, name)
        change = f"{(now / was - 1) * 100:+.0f}%" if was else "-"
        lines.append(f"  {name}: {was:g} -> {now:g} ({change})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", required=True, choices=run_vllm_bench.VLLM_REGIMES)
    parser.add_argument(
        "--out", type=Path, default=None, help="where the benchmark and step log go (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvgate-fit-"))
    out.mkdir(parents=True, exist_ok=True)
    steps_path = out / "steps.txt"
    steps_path.unlink(missing_ok=True)
    os.environ[STEP_LOG_ENV] = str(steps_path)  # the vLLM server the runner starts inherits it
    try:
        status = run_vllm_bench.main(
            ["--regime", args.regime, "--pinning", "pinned", "--out", str(out), "--modes", "sticky", "--repeat", "1"]
            + ["--no-plots", "--seed", str(SEED)]
        )
    finally:
        os.environ.pop(STEP_LOG_ENV, None)
    if status != 0 or not steps_path.exists():
        print(f"fit_cpu_engine: the benchmark failed (exit {status}); see {out}", file=sys.stderr)
        return 1
    server_tokens = json.loads((out / "results.json").read_text())["modes"]["sticky"]["prompt_tokens_queried"]
    regime = REGIMES[args.regime]
    simulated = simulated_prompt_tokens(generate_workload(regime.workload, SEED))
    measured = measured_engine(read_steps(steps_path), int(server_tokens), simulated)
    if measured is None:
        print(f"fit_cpu_engine: the steps in {steps_path} give no fit", file=sys.stderr)
        return 1
    (out / "cpu_engine.json").write_text(json.dumps(dataclasses.asdict(measured)) + "\n")
    print(compare(regime.cpu_engine, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
