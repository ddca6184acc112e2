"""`kvgate bench probe-latency`: it runs end to end against a simulated replica (small, no
timing asserts), and it fails on a server without the probe API."""

from __future__ import annotations

import asyncio
import json
import sys

from kvgate.simulator.replica_server import start_simulated_replicas


async def run_benchmark(url: str, *options: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        "bench",
        "probe-latency",
        "--url",
        url,
        *options,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_probe_latency_runs_idle_and_under_load(tmp_path):
    # time_scale 1: load requests take real engine steps, so they are running while probed
    (replica,) = await start_simulated_replicas(1, time_scale=1.0)
    out = tmp_path / "probe-latency.json"
    try:
        code, stdout, stderr = await run_benchmark(
            replica.url, "--samples", "5", "--load-clients", "2", "--prompt-words", "200", "--out", str(out)
        )
        assert code == 0, stdout + stderr
        result = json.loads(out.read_text())
        for phase in ("idle", "load"):
            for probe in ("kv", "prefix"):
                row = result[phase][probe]
                assert row["samples"] == 5, (phase, probe)
                assert 0 < row["p50_ms"] <= row["p95_ms"] <= row["max_ms"], (phase, probe)
        assert result["prefix_probe_tokens"] > 200  # the chat body was rendered by the replica
        assert result["load_max_running"] > 0 and result["load_requests"] > 0
        assert result["load_failed_requests"] == 0
        assert "load (" in stdout and "prefix" in stdout  # the table was printed
        state = replica.engine.kv_answer()
        assert state.num_running == state.num_waiting == 0  # every load request ended
    finally:
        await replica.stop()


async def test_probe_latency_fails_without_the_probe_api(aiohttp_server):
    from aiohttp import web

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()  # a server with /v1/models and no probe routes
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    code, stdout, stderr = await run_benchmark(str(server.make_url("")), "--samples", "1")
    assert code == 1, stdout + stderr
    assert "/v1/kvgate/prefix answered 404" in stderr
