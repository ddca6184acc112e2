"""`kvgate serve` as a process: the command the container image runs."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import aiohttp
from serve_process import start_serve, stop_serve

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_serve_forwards_to_configured_replicas(upstreams, tmp_path):
    config = tmp_path / "kvgate.yaml"
    config.write_text("replicas:\n" + "".join(f"  - {{name: {f.name}, url: '{f.url}'}}\n" for f in upstreams))
    proc, lines, url = await start_serve("--config", str(config))
    try:
        assert "2 configured replicas" in lines[0]
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": "x"}) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvgate-replica"] in ("r0", "r1")
            async with http.get(url + "/ready") as resp:
                assert resp.status == 200
    finally:
        assert await stop_serve(proc) == 0


async def test_serve_without_replicas_starts_simulated_ones_and_says_so_first(tmp_path):
    config = tmp_path / "empty.yaml"
    config.write_text("simulated_replicas: 2\n")
    proc, lines, url = await start_serve("--config", str(config))
    try:
        assert "no replicas configured: starting 2 simulated replicas" in lines[0]
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": "y"}) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvgate-replica"].startswith("sim")
                assert (await resp.json())["object"] == "chat.completion"
            async with http.get(url + "/metrics") as resp:
                metrics = await resp.text()
        # The admission gate is on by default: it probed the replica's KV usage.
        assert re.search(r'kvgate_probe_seconds_count\{probe="kv",replica="sim\d"\} [1-9]', metrics), metrics
    finally:
        assert await stop_serve(proc) == 0


async def test_serve_with_an_invalid_config_exits_2(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("gate: {high_watermark: 3}\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        "serve",
        "--config",
        str(config),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 2
    assert b"gate.high_watermark" in err
