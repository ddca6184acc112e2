"""Run several check scripts of this folder from one import of vLLM; print one JSON line.

Run by the vLLM venv's python: ``run_checks.py SCRIPT [SCRIPT ...]``. Importing torch and
vLLM's core takes about 6 s of a check's 7; this process imports them once (through
probe_side_effects, which every check imports), then runs each script in a forked child
of its own, as ``__main__``, with the child's stdout and stderr going to files: each
check starts from the same freshly imported state and nothing it changes reaches the
next, as when each ran in a process of its own. The last line printed is
``{script: {"returncode": int, "stdout": str, "stderr": str}}``, stderr cut to its tail.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import probe_side_effects  # noqa: F401  (torch and vLLM's core, imported once before the forks)

HERE = Path(__file__).resolve().parent
TIMEOUT_SEC = 300.0
STDERR_TAIL = 4000


def run_in_child(script: Path, stdout: int, stderr: int) -> None:
    """The forked child: run `script` as __main__ with its output on the given files; never returns."""
    code = 1
    try:
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        sys.argv = [str(script)]
        try:
            runpy.run_path(str(script), run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_for(pid: int, timeout: float) -> int:
    """The child's exit code; killed (-9) once `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def run(script: Path) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_in_child(script, out.fileno(), err.fileno())
        returncode = wait_for(pid, TIMEOUT_SEC)
        out.seek(0)
        err.seek(0)
        return {
            "returncode": returncode,
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace")[-STDERR_TAIL:],
        }


def main(names: list[str]) -> int:
    if not names:
        print("usage: run_checks.py SCRIPT [SCRIPT ...]  (scripts of this folder)", file=sys.stderr)
        return 2
    results = {name: run(HERE / name) for name in names}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
