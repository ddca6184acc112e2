"""bench/processes.py: a server whose free port another process takes first starts on another.

`free_port` hands out a port the kernel found free; until the server started on it binds
it, another process (another test's server, started at the same moment) may take it and
answer the readiness check in its place. Here a server of this test process already
listens on the first port handed out: the replica must end up on a port of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import aiohttp
from aiohttp import web

from kvgate.bench import processes
from kvgate.bench.listeners import listens_on
from kvgate.bench.processes import ReplicaShape, ServerGroup


def test_listens_on_tells_the_listening_process_from_others():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert listens_on(os.getpid(), port) is None  # bound, not listening: nobody listens
        sock.listen()
        assert listens_on(os.getpid(), port) is True
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert listens_on(other.pid, port) is False
        finally:
            other.kill()
            other.wait()


async def test_a_replica_whose_port_is_taken_starts_on_another(tmp_path, monkeypatch):
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="not the replica")

    squatter = web.Application()
    squatter.router.add_get("/health", health)
    runner = web.AppRunner(squatter)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    taken = runner.addresses[0][1]
    real_free_port = processes.free_port
    handed_out = iter([taken])
    monkeypatch.setattr(processes, "free_port", lambda: next(handed_out, None) or real_free_port())
    try:
        async with ServerGroup(tmp_path) as servers:
            url = await servers.start_replica("r0", ReplicaShape())
            port = int(url.rsplit(":", 1)[1])
            assert port != taken
            (pid,) = servers.pids().values()  # the first replica, on the taken port, is gone
            assert listens_on(pid, port) is True
            async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
                assert resp.status == 200 and await resp.text() != "not the replica"
    finally:
        await runner.cleanup()
