"""bench/processes.py: a benchmark stopped with SIGTERM leaves no server behind.

A real benchmark-like process opens a `ServerGroup`, starts a simulated replica (ready)
and then a server that never gets ready, so SIGTERM finds it mid-start. Without the
group's SIGTERM handling, Python's default action ends the benchmark without unwinding
and both children keep running, re-parented.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvgate.bench.processes import SIGTERM_EXIT_STATUS

BENCH = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from kvgate.bench.processes import ReplicaShape, ServerGroup

    async def main():
        async with ServerGroup(Path(sys.argv[1])) as servers:
            await servers.start_replica("r0", ReplicaShape())
            await servers.start_module("stuck", "never_ready", [])  # still starting when SIGTERM comes
            print("unreachable: never_ready answered", flush=True)

    asyncio.run(main())
    """
)
NEVER_READY = "import time\ntime.sleep(600)  # never listens: its start never completes\n"


def children(pid: int) -> set[int]:
    """The live (not zombie) processes whose parent is `pid`, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def test_sigterm_while_servers_start_stops_every_child(tmp_path):
    (tmp_path / "never_ready.py").write_text(NEVER_READY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH, str(tmp_path / "logs")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started: set[int] = set()
    try:
        # The replica answered (the group moved on) and the stuck server runs: two children.
        # 120 s: starting a replica takes seconds on a loaded machine, not minutes.
        def starting() -> bool:
            assert bench.poll() is None, bench.communicate()[0]
            return (tmp_path / "logs" / "stuck.log").exists() and len(children(bench.pid)) == 2

        wait_for(
            starting,
            "the replica to be ready and the second server to be starting",
            120,
        )
        started = children(bench.pid)
        bench.send_signal(signal.SIGTERM)
        output, _ = bench.communicate(timeout=60)  # the group waits up to 10 s per child, then kills it
        survivors = {pid for pid in started if alive(pid)}
        assert not survivors, f"the benchmark left {sorted(survivors)} running after SIGTERM"
        assert bench.returncode == SIGTERM_EXIT_STATUS, output
    finally:
        for pid in started | (children(bench.pid) if bench.poll() is None else set()):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
            bench.wait()
