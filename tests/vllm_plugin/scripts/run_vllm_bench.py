"""Run `kvgate bench agentic` against a real vLLM CPU server started for the regime.

    .venv/bin/python tests/vllm_plugin/scripts/run_vllm_bench.py --regime vllm-prefill \\
        [--pinning pinned|unpinned|both --repeat N --modes sticky,kvgate-working_set --out DIR ...]

For the real-vLLM regimes (`vllm-small`, `vllm-prefill` and their `-no-finish` variants):
provisions what tests/vllm_plugin provisions (the vLLM CPU venv, `KVGATE_VLLM_VENV` overrides
its path, and the regime's random-weight model under ~/.cache/kvgate/models), starts
one vLLM server with the kvgate plugin sized by the regime's replica shape
(`--num-gpu-blocks-override num_blocks + 1`, block size, sequences, max model length,
tokens per engine step,
`VLLM_SERVER_DEV_MODE=1` so the benchmark can reset the prefix cache between modes),
prints that server's command line, runs `python -m kvgate.bench.agentic --regime R
--replica-url URL` with every other option passed through, and stops the server
(also on failure or Ctrl-C).

`--retention` (default on) loads the plugin's retention connector (`--kv-transfer-config`,
docs/vllm-plugin.md, KV pins): a gate that pins the windows it admits for keeps them in
vLLM; `--no-retention` leaves vLLM's own LRU eviction alone (the rows before KV pins).

`--pinning` (default `both`: pinned, then unpinned, each with its own server):
- pinned, the split of a GPU host, where the engine's compute never takes the CPU of the
  API server, kvgate or the clients: vLLM binds its worker's OpenMP threads to the
  engine's CPUs (`VLLM_CPU_OMP_THREADS_BIND`, the upper half of this process's CPUs), the
  runner pins the rest of the engine (engine core, worker threads) there too, and vLLM's
  API server, kvgate and the load generator to the other CPUs. Refused with fewer than 2 CPUs.
- unpinned: every process may run on every CPU, vLLM's OpenMP threads unbound
  (`VLLM_CPU_OMP_THREADS_BIND=nobind`), as a CPU-only host shares them.
Each run prints every process's CPUs as it appears (from /proc, sampled each second) and
writes them to `pinning.json` beside the benchmark's results; with `both`, each run's
results go to `OUT/pinned` and `OUT/unpinned`. A pinned run fails (exit 3) if a thread
was seen outside its side's CPUs. The exit status is otherwise the first failing benchmark's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/vllm_plugin: the harness
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: bench, proxy

from vllm_harness import REPO_ROOT, VllmServer, ensure_model, ensure_vllm_venv, stop_process_group  # noqa: E402

from kvgate.bench.agentic.regimes import REGIMES  # noqa: E402
from kvgate.bench.cpu_split import (  # noqa: E402
    ENGINE,
    FRONTEND,
    CpuSplit,
    PinningError,
    ProcessAffinity,
    format_cpu_list,
    pin_server_tree,
    plan_split,
    process_name,
    read_parents,
    snapshot,
    tree_roles,
    violations,
)
from kvgate.vllm_plugin.pin_keeper import CONNECTOR_CONFIG  # noqa: E402

VLLM_REGIMES = sorted(name for name, regime in REGIMES.items() if regime.vllm_model)
PINNINGS = ("pinned", "unpinned", "both")
EXIT_PINNING_BROKEN = 3
# printed (flushed) just before a pinned run's runner takes back every CPU: the split holds until then
TAKING_BACK_CPUS = "taking back CPUs"


def server_for(
    regime_name: str,
    python: Path,
    model_dir: Path,
    log_path: Path,
    split: CpuSplit | None = None,
    retention: bool = True,
) -> VllmServer:
    """The vLLM server a regime's replica shape describes (num_blocks usable + vLLM's null block);
    with a `split`, vLLM binds its worker's OpenMP threads to the split's engine CPUs; with
    `retention`, it loads the plugin's retention connector (KV pins, docs/vllm-plugin.md)."""
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
        extra_args=(
            ("--max-num-batched-tokens", str(shape.max_num_batched_tokens))
            + (("--kv-transfer-config", CONNECTOR_CONFIG) if retention else ())
        ),
        extra_env=() if split is None else (("VLLM_CPU_OMP_THREADS_BIND", split.omp_threads_bind),),
    )


def runs_of(pinning: str, out: Path) -> list[tuple[str, Path]]:
    """(pinning, results folder) of each run `--pinning` asks for: `both` is pinned, then
    unpinned, in subfolders of `out` named after them."""
    if pinning == "both":
        return [("pinned", out / "pinned"), ("unpinned", out / "unpinned")]
    return [(pinning, out)]


def process_label(pid: int) -> str:
    """What a process of the run is, from its command line (its comm name otherwise)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return process_name(pid)
    words = [a.decode(errors="replace") for a in argv]
    if "vllm.entrypoints.openai.api_server" in words:
        return "vLLM API server"
    if "kvgate.bench.agentic" in words:
        return "load generator"
    if "serve" in words and any(w.startswith("kvgate.") for w in words):
        return "kvgate serve"
    return process_name(pid)


class AffinityWatch:
    """Samples, once a second while a benchmark runs, the CPUs of every thread of the vLLM server's
    tree (its API server: frontend; below it: engine) and of the benchmark's (the load generator and
    the kvgate proxies it starts: frontend). Prints each process the first time it is seen, and keeps
    every violation of `split` (none is checked when unpinned)."""

    def __init__(self, server_pid: int, bench_pid: int, split: CpuSplit | None, interval: float = 1.0):
        self.server_pid, self.bench_pid, self.split, self.interval = server_pid, bench_pid, split, interval
        self.seen: dict[int, ProcessAffinity] = {}
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="affinity-watch", daemon=True)

    def sample(self) -> None:
        parents = read_parents()
        roles = {
            **tree_roles(parents, self.server_pid, FRONTEND, ENGINE),
            **tree_roles(parents, self.bench_pid, FRONTEND, FRONTEND),
        }
        for process in snapshot(roles, name=process_label):
            if process.pid not in self.seen:
                print(f"[run_vllm_bench]   {process.describe()}", flush=True)
            self.seen[process.pid] = process
            if self.split is not None:
                self.violations += [v for v in violations([process], self.split) if v not in self.violations]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> AffinityWatch:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_one(
    regime: str,
    pinning: str,
    split: CpuSplit | None,
    python: Path,
    model_dir: Path,
    out: Path,
    log_path: Path,
    bench_args: list[str],
    retention: bool = True,
) -> int:
    """One server, one benchmark, pinned when `split` is given; the benchmark's exit status, or
    EXIT_PINNING_BROKEN when a thread ran outside its side's CPUs."""
    server = server_for(regime, python, model_dir, log_path, split, retention)
    server.port = 0
    own_cpus = os.sched_getaffinity(0)
    try:
        server.start()
        omp_bind = server.environment()["VLLM_CPU_OMP_THREADS_BIND"]
        env = (
            ("VLLM_PLUGINS", "kvgate"),
            ("VLLM_CPU_OMP_THREADS_BIND", omp_bind),
            ("VLLM_SERVER_DEV_MODE", "1"),
        )
        print(
            f"[run_vllm_bench] {pinning}: vLLM at {server.url} (log {log_path}):\n  "
            + " ".join(f"{k}={v}" for k, v in env)
            + " "
            + shlex.join(server.command()),
            flush=True,
        )
        assert server.process is not None
        if split is not None:
            moved = pin_server_tree(server.process.pid, split)
            os.sched_setaffinity(0, split.frontend)  # the benchmark and its kvgate proxies inherit it
            print(
                f"[run_vllm_bench] pinned: {split.describe()} (threads the runner moved, by pid: "
                f"{', '.join(f'{pid}: {n}' for pid, n in sorted(moved.items()))}; the others vLLM had bound)",
                flush=True,
            )
        else:
            print(f"[run_vllm_bench] unpinned: every process on CPUs {format_cpu_list(own_cpus)}", flush=True)
        command = [
            sys.executable,
            "-m",
            "kvgate.bench.agentic",
            "--regime",
            regime,
            "--replica-url",
            server.url,
            "--out",
            str(out),
            *bench_args,
        ]
        print(f"[run_vllm_bench] {shlex.join(command)}", flush=True)
        # Its own process group: stopping it also stops the kvgate proxies it started.
        bench = subprocess.Popen(command, cwd=REPO_ROOT, start_new_session=True)
        try:
            with AffinityWatch(server.process.pid, bench.pid, split) as watch:
                status = bench.wait()
        finally:
            stop_process_group(bench, grace=15)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pinning.json").write_text(
            json.dumps(
                {
                    "pinning": pinning,
                    "engine_cpus": None if split is None else format_cpu_list(split.engine),
                    "frontend_cpus": None if split is None else format_cpu_list(split.frontend),
                    "omp_threads_bind": omp_bind,
                    "processes": [p.as_dict() for p in watch.seen.values()],
                    "violations": watch.violations,
                },
                indent=1,
            )
            + "\n"
        )
        if watch.violations:
            print("[run_vllm_bench] the split did not hold:\n  " + "\n  ".join(watch.violations), file=sys.stderr)
            return status or EXIT_PINNING_BROKEN
        if split is not None:
            print(f"[run_vllm_bench] pinned: {len(watch.seen)} processes stayed on their CPUs", flush=True)
        return status
    finally:
        if split is not None:
            print(f"[run_vllm_bench] {TAKING_BACK_CPUS} {format_cpu_list(own_cpus)}", flush=True)
        os.sched_setaffinity(0, own_cpus)
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", required=True, choices=VLLM_REGIMES)
    parser.add_argument(
        "--pinning",
        choices=PINNINGS,
        default="both",
        help="pinned: the engine on CPUs of its own (a GPU host's split); unpinned: all share every CPU; "
        "both: pinned, then unpinned (default)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results/agentic"), help="results folder (default results/agentic)"
    )
    parser.add_argument(
        "--vllm-log", type=Path, default=None, help="the server's log file (default: a temporary folder, printed)"
    )
    parser.add_argument(
        "--retention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load the plugin's retention connector, so the gate can pin the windows it admits for "
        "(default on; --no-retention: vLLM's own LRU eviction alone)",
    )
    args, bench_args = parser.parse_known_args(argv)
    runs = runs_of(args.pinning, args.out)
    split = None
    if any(pinning == "pinned" for pinning, _ in runs):
        try:
            split = plan_split(os.sched_getaffinity(0))
        except PinningError as exc:
            print(f"run_vllm_bench: {exc}", file=sys.stderr)
            return 2
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the finally blocks stop both groups.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    python = ensure_vllm_venv()
    model_dir = ensure_model(python, REGIMES[args.regime].vllm_model)
    log_dir = Path(tempfile.mkdtemp(prefix="kvgate-vllm-"))
    status = 0
    for pinning, out in runs:
        log_path = log_dir / f"vllm-{pinning}.log"
        if args.vllm_log is not None:
            log_path = args.vllm_log if len(runs) == 1 else args.vllm_log.with_stem(f"{args.vllm_log.stem}-{pinning}")
        code = run_one(
            args.regime,
            pinning,
            split if pinning == "pinned" else None,
            python,
            model_dir,
            out,
            log_path,
            bench_args,
            args.retention,
        )
        status = status or code
    return status


if __name__ == "__main__":
    sys.exit(main())
