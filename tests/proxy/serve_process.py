"""`kvgate serve` as a subprocess, for the tests that run the command the container runs."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


async def start_serve(*args: str) -> tuple[asyncio.subprocess.Process, list[str], str]:
    """Start `kvgate serve --port 0 ...`; return the process, its log lines so far, its URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        "serve",
        "--port",
        "0",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    lines: list[str] = []
    try:
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
            if not line:
                raise AssertionError("kvgate serve exited early:\n" + "".join(lines))
            lines.append(line)
            found = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if found:
                return proc, lines, found.group(1)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise


async def stop_serve(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), timeout=30)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
