"""The wall-clock half of tests/bench/test_cluster_crosscheck.py, run in the background.

Two `kvgate bench agentic` runs (sticky and the working_set gate) on the thrash regime,
in real time: about 25 s each, nearly all of it asleep (engine steps, a closed loop of
HTTP turns). `RUNS.start()` starts both at once and returns; `RUNS.results()` waits
for them. tests/conftest.py starts them when the first test of the crosscheck's xdist
group starts, so the tests it puts in that group run while the benchmarks sleep, and
the crosscheck's own tests, last in the group, wait only for what is left.

While they run, `Lateness` measures how late this machine wakes a sleeping process (in
a process of its own: a thread here would also count the wait for this process's GIL
while the group's other tests run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHANGES = {"sessions": 12, "concurrency": 12, "turns_min": 4, "turns_max": 5}
# Steps 10x the cost model's (thrash runs 1.5x): what the wall-clock run adds per step and
# per turn (a late wake-up, an HTTP hop, a prefix probe that a starved replica answers in
# tens of milliseconds) stays about the same at any scale, so longer steps keep it a small
# share of each turn. At 4x, with six busy loops beside it on two cores, the gated run's
# makespan came out 1.7x virtual time's; at 10x, 1.12x.
TIME_SCALE = 10.0
MODES = {"sticky": "sticky", "kvgate-working_set": "working_set"}  # bench mode -> cluster policy

# Sleeps `period` seconds at a time until its stdin closes; prints the samples and their mean lateness.
_SAMPLER = """
import sys, threading, time
period, samples, stop = float(sys.argv[1]), [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    started = time.monotonic()
    time.sleep(period)
    samples.append(max(0.0, time.monotonic() - started - period))
print(len(samples), sum(samples) / len(samples) if samples else 0.0)
"""


class Lateness:
    """How late this machine wakes a sleeping process, on average, between start() and stop()."""

    def __init__(self, period_sec: float = 0.005) -> None:
        self.period = period_sec
        self.samples = 0
        self.mean_sec = 0.0
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, str(self.period)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def stop(self) -> None:
        if self._process is None:
            return
        out, _ = self._process.communicate("", timeout=60)
        self._process = None
        samples, mean = out.split()
        self.samples, self.mean_sec = int(samples), float(mean)


def _start_bench(out: Path, mode: str) -> subprocess.Popen:
    options = [f"--{name.replace('_', '-')}={value}" for name, value in CHANGES.items()]
    return subprocess.Popen(
        [sys.executable, "-m", "kvgate.bench.agentic", "--regime", "thrash", "--modes", mode,
         *options, f"--time-scale={TIME_SCALE}", "--out", str(out), "--no-plots", "--request-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _finish_bench(process: subprocess.Popen, out: Path, mode: str) -> dict:
    printed, _ = process.communicate(timeout=900)  # a hang, not a slow machine
    assert process.returncode == 0, printed[-6000:]
    return json.loads((out / "results.json").read_text())["modes"][mode]


class WallClockRuns:
    """Both modes' benchmark runs, started once, at once; stop() ends whatever still runs."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._processes: dict[str, subprocess.Popen] = {}
        self._lateness = Lateness()
        self._outcome: tuple[dict, Lateness] | BaseException | None = None

    def start(self) -> None:
        if self._root is not None:
            return
        self._root = Path(tempfile.mkdtemp(prefix="kvgate-crosscheck-"))
        self._lateness.start()
        self._processes = {mode: _start_bench(self._root / mode, mode) for mode in MODES}

    def results(self) -> tuple[dict, Lateness]:
        """Each mode's summary and the lateness while they ran; waits for the runs (starts them if need be)."""
        self.start()
        assert self._root is not None
        if self._outcome is None:
            try:
                runs = {
                    mode: _finish_bench(process, self._root / mode, mode) for mode, process in self._processes.items()
                }
                self._lateness.stop()
                self._outcome = (runs, self._lateness)
            except BaseException as failure:  # every test of the pair reports it
                self._outcome = failure
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def stop(self) -> None:
        for process in self._processes.values():
            if process.poll() is None:  # the harness stops its servers on SIGTERM
                process.terminate()
                process.wait(timeout=60)
        self._lateness.stop()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)


RUNS = WallClockRuns()
