"""The event loop kvgate's processes run on: uvloop when it is installed.

A module of its own, importing nothing of kvgate, so that a process that only needs the
loop (the benchmarks' load generator and upstream) starts without importing the proxy.
"""

from __future__ import annotations

import asyncio


def run(coro) -> None:
    """Run `coro` on uvloop when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)
