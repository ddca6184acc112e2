"""What an open status page costs kvgate: its CPU time with and without the page polling.

    .venv/bin/python -m tests.browser.page_cost [--seconds 60] [--sessions 1000]

Starts `kvgate serve` (two simulated replicas in its process, an admin token, windows
that outlive the run), books `--sessions` sessions with one turn each, then reads the
process's CPU time (user + system, /proc/<pid>/stat) over `--seconds` with no page open
and over `--seconds` with the page open in headless Chromium (Debian's, as the browser
tests drive it), and prints both as a share of one core and their difference: the page's
cost. Not a test: a measurement (docs/observability.md, The status page).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

from tests.browser.conftest import CHROMIUM_ARGS
from tests.proxy.serve_process import start_until_listening, stop_serve
from tests.ui.stack import turn

TOKEN = "page-cost-token"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def core_share(pid: int, seconds: float) -> float:
    before, started = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


async def book_sessions(url: str, count: int) -> None:
    semaphore = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        async with semaphore:
            status, _ = await turn(url, f"session-{i:05d}")
            assert status == 200, status

    await asyncio.gather(*(one(i) for i in range(count)))


async def measure(seconds: float, sessions: int) -> None:
    from playwright.async_api import async_playwright

    env = {
        **os.environ,
        "KVGATE_ADMIN__TOKEN": TOKEN,
        "KVGATE_GATE__IDLE_GRACE_SEC": "3600",
        "KVGATE_GATE__QUIET_FLOOR_SEC": "3600",
        "KVGATE_SIMULATED_REPLICAS": "2",
    }
    proc, _, url = await start_until_listening([sys.executable, "-m", "kvgate.cli", "serve", "--port", "0"], env=env)
    drain = asyncio.create_task(proc.stdout.read())  # its log must not fill the pipe and block it
    try:
        await book_sessions(url, sessions)
        await asyncio.sleep(2)
        idle = await core_share(proc.pid, seconds)
        with tempfile.TemporaryDirectory() as profile:
            async with async_playwright() as playwright:
                context = await playwright.chromium.launch_persistent_context(
                    profile,
                    executable_path=os.environ.get("KVGATE_CHROMIUM", "/usr/bin/chromium"),
                    headless=True,
                    args=CHROMIUM_ARGS,
                )
                page = await context.new_page()
                await page.goto(f"{url}/admin/ui")
                await page.fill("#token", TOKEN)
                await page.click("#login-form button[type=submit]")
                await page.wait_for_selector("#sessions tbody tr[data-session]")
                open_page = await core_share(proc.pid, seconds)
                await context.close()
    finally:
        await stop_serve(proc)
        await drain
    print(
        f"kvgate CPU, {sessions} sessions, {seconds:g} s each: no page {100 * idle:.2f}% of a core, "
        f"page open {100 * open_page:.2f}%, the page's cost {100 * (open_page - idle):.2f}% of a core"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--sessions", type=int, default=1000)
    args = parser.parse_args()
    asyncio.run(measure(args.seconds, args.sessions))


if __name__ == "__main__":
    main()
