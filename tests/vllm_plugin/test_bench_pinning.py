"""run_vllm_bench.py --pinning pinned splits the CPUs as it says, checked from outside.

The runner starts vLLM (tiny model), pins it and runs the smallest benchmark (2 sessions
of 1-2 turns, sticky then the gate). While it runs, this test reads /proc itself, every
quarter second from the runner's announcement of its split to its word that it takes back
its CPUs: the threads of vLLM's API server, of the load generator and of each `kvgate serve`
may run only on the frontend's CPUs, those of every process below the API server (vLLM's
engine core and worker) only on the engine's, the two sets are disjoint, and the split
announced is the upper half of the CPUs for the engine. Nothing is timed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_harness import REPO_ROOT, log_tail, stop_process_group

from kvgate.bench.cpu_split import descendants, parse_cpu_list, read_parents, thread_affinities

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a pinned run needs 2 CPUs"),
]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "run_vllm_bench.py"
ANNOUNCED = re.compile(r"\[run_vllm_bench\] pinned: engine CPUs (\S+), frontend CPUs (\S+) ")
TAKING_BACK = "[run_vllm_bench] taking back CPUs"


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def observe(runner_pid: int, seen: dict[tuple[str, int], set[int]]) -> None:
    """Add the CPUs each of the run's processes' threads may use now to `seen[(what, pid)]`."""
    parents = read_parents()
    below_runner = descendants(parents, runner_pid)
    servers = [pid for pid in below_runner if "vllm.entrypoints.openai.api_server" in cmdline(pid)]
    engine = {pid for server in servers for pid in descendants(parents, server)}
    for pid in [runner_pid, *below_runner]:
        argv = cmdline(pid)
        if pid in engine:
            what = "engine"
        elif pid in servers:
            what = "api server"
        elif "kvgate.bench.agentic" in argv:
            what = "load generator"
        elif "serve" in argv and "kvgate.cli" in argv:
            what = "kvgate"
        elif pid == runner_pid:
            what = "runner"
        else:
            what = "other: " + " ".join(argv)[:80]
        for cpus in thread_affinities(pid).values():
            seen.setdefault((what, pid), set()).update(cpus)


def test_a_pinned_run_keeps_the_engine_and_the_frontend_on_their_own_cpus(vllm_python, tiny_model, tmp_path):
    log = tmp_path / "runner.log"
    command = [
        sys.executable,
        str(SCRIPT),
        "--regime",
        "vllm-small-no-finish",
        "--pinning",
        "pinned",
        "--out",
        str(tmp_path / "out"),
        "--modes",
        "sticky,kvgate-working_set",
        "--repeat",
        "1",
        "--no-plots",
        "--sessions",
        "2",
        "--concurrency",
        "2",
        # each mode's kvgate lives long enough (seconds) for the 0.25 s sampling to see it
        "--turns-min",
        "4",
        "--turns-max",
        "5",
    ]
    seen: dict[tuple[str, int], set[int]] = {}
    with open(log, "wb") as out:
        runner = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while runner.poll() is None and time.monotonic() < deadline:
            # From the split's announcement until the runner says it takes back its CPUs. It says so
            # before it does, so a sample is kept only when the log still lacks that line after it.
            if ANNOUNCED.search(log.read_text(errors="replace")):
                sample: dict[tuple[str, int], set[int]] = {}
                observe(runner.pid, sample)
                if TAKING_BACK not in log.read_text(errors="replace"):
                    for key, cpus in sample.items():
                        seen.setdefault(key, set()).update(cpus)
            time.sleep(0.25)
        assert runner.poll() == 0, f"runner exit {runner.returncode}:\n{log_tail(log)}"
    finally:
        stop_process_group(runner)
    announced = ANNOUNCED.search(log.read_text())
    assert announced, log_tail(log)
    engine, frontend = parse_cpu_list(announced.group(1)), parse_cpu_list(announced.group(2))
    cpus = sorted(os.sched_getaffinity(0))
    assert engine == set(cpus[len(cpus) - len(cpus) // 2 :]) and frontend == set(cpus[: len(cpus) - len(cpus) // 2])

    kinds = {what for what, _ in seen}
    assert {"engine", "api server", "load generator", "kvgate", "runner"} <= kinds, seen
    assert len([pid for what, pid in seen if what == "engine"]) >= 2, "vLLM's engine core and worker: " + str(seen)
    assert len([pid for what, pid in seen if what == "kvgate"]) >= 2, "one kvgate per mode: " + str(seen)
    for (what, pid), used in seen.items():
        allowed = engine if what == "engine" else frontend
        assert used <= allowed, f"{what} (pid {pid}) had threads allowed on CPUs {sorted(used)}, not only {allowed}"
    assert (tmp_path / "out" / "pinning.json").exists() and (tmp_path / "out" / "results.json").exists()
