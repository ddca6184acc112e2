"""Run `kvgate bench agentic` against a real vLLM CPU server started for the regime.

    .venv/bin/python tests/vllm/scripts/run_vllm_bench.py --regime vllm-prefill \\
        [--repeat N --modes direct,sticky,kvgate-working_set --out results/vllm-prefill ...]

For the real-vLLM regimes (`vllm-small`, `vllm-prefill` and their `-no-finish` variants):
provisions what tests/vllm provisions (the vLLM CPU venv, `KVGATE_VLLM_VENV` overrides
its path, and the regime's random-weight model under ~/.cache/kvgate/models), starts
one vLLM server with the kvgate plugin sized by the regime's replica shape
(`--num-gpu-blocks-override num_blocks + 1`, block size, sequences, max model length,
tokens per engine step,
`VLLM_SERVER_DEV_MODE=1` so the benchmark can reset the prefix cache between modes),
prints that server's command line, runs `python -m kvgate.bench.agentic --regime R
--replica-url URL` with every other option passed through, and stops the server
(also on failure or Ctrl-C). The exit status is the benchmark's.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/vllm: the harness
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: bench, proxy

from vllm_harness import REPO_ROOT, VllmServer, ensure_model, ensure_vllm_venv, stop_process_group  # noqa: E402

from kvgate.bench.agentic.regimes import REGIMES  # noqa: E402

VLLM_REGIMES = sorted(name for name, regime in REGIMES.items() if regime.vllm_model)


def server_for(regime_name: str, python: Path, model_dir: Path, log_path: Path) -> VllmServer:
    """The vLLM server a regime's replica shape describes (num_blocks usable + vLLM's null block)."""
    regime = REGIMES[regime_name]
    shape = regime.shape
    return VllmServer(
        python=python,
        model_dir=model_dir,
        log_path=log_path,
        block_size=shape.block_size,
        num_blocks=shape.num_blocks + 1,
        max_num_seqs=shape.max_num_seqs,
        served_model_name=regime.vllm_model,
        extra_args=("--enable-prompt-tokens-details", "--max-num-batched-tokens", str(shape.max_num_batched_tokens)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", required=True, choices=VLLM_REGIMES)
    parser.add_argument(
        "--vllm-log", type=Path, default=None, help="the server's log file (default: a temporary folder, printed)"
    )
    args, bench_args = parser.parse_known_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the finally blocks stop both groups.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    python = ensure_vllm_venv()
    model_dir = ensure_model(python, REGIMES[args.regime].vllm_model)
    log_path = args.vllm_log or Path(tempfile.mkdtemp(prefix="kvgate-vllm-")) / "vllm.log"
    server = server_for(args.regime, python, model_dir, log_path)
    server.port = 0
    try:
        server.start()
        print(
            f"[run_vllm_bench] vLLM at {server.url} (log {log_path}):\n  "
            + " ".join(
                f"{k}={v}"
                for k, v in (
                    ("VLLM_PLUGINS", "kvgate"),
                    ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                    ("VLLM_SERVER_DEV_MODE", "1"),
                )
            )
            + " "
            + shlex.join(server.command()),
            flush=True,
        )
        command = [
            sys.executable,
            "-m",
            "kvgate.bench.agentic",
            "--regime",
            args.regime,
            "--replica-url",
            server.url,
            *bench_args,
        ]
        print(f"[run_vllm_bench] {shlex.join(command)}", flush=True)
        # Its own process group: stopping it also stops the kvgate proxies it started.
        bench = subprocess.Popen(command, cwd=REPO_ROOT, start_new_session=True)
        try:
            return bench.wait()
        finally:
            stop_process_group(bench, grace=15)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
