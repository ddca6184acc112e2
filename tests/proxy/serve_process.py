"""`kvgate serve` as a subprocess, for the tests that run the command the container runs."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


async def start_until_listening(
    argv: list[str], env: dict[str, str] | None = None, cwd: Path = REPO
) -> tuple[asyncio.subprocess.Process, list[str], str]:
    """Start `argv` (a `kvgate serve` command); return the process, its log lines until
    it says where it listens, and that URL. A process that exits first fails the test."""
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
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


async def start_serve(*args: str) -> tuple[asyncio.subprocess.Process, list[str], str]:
    """Start `kvgate serve --port 0 ...`; return the process, its log lines so far, its URL."""
    return await start_until_listening([sys.executable, "-m", "kvgate.cli", "serve", "--port", "0", *args])


async def stop_serve(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), timeout=30)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
