"""A client killed mid-stream leaves nothing behind: Claude Code (`claude -p`) is sent
SIGINT while its first turn streams through `kvgate serve`, and once the session's quiet
expiry has passed kvgate's /admin/state holds no lease, window or waiter for it, and the
access log shows the turn ended with status 499 (the client left), not a 5xx.

The replica is a simulated one whose replies run ~20,000 tokens (about two minutes at
time scale 1; Claude Code's `max_tokens` caps them higher), so that the turn is still
streaming when the client is stopped; the gate runs its defaults (docs/clients.md has the
same setup)."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid

import aiohttp
import pytest
from client_harness import (
    NPM_CLIENT,
    access_records,
    client_env,
    ensure_npm_client,
    task_folder,
)
from test_claude_code import CLAUDE_CODE_VERSION, QUIET_ENV, READ_ONLY_TOOLS

from kvgate.bench.processes import ServerGroup
from kvgate.bench.scale_out_load import leaks_of

pytestmark = NPM_CLIENT

ADMIN_TOKEN = "client-interrupt-admin"
# `kvgate replica` flags: every reply ~20,000 tokens of text, never a tool call.
LONG_REPLIES = ["--reply-median-tokens", "20000", "--reply-sigma", "0", "--tool-call-rate", "0"]
# Session records (gap history) outlive a session's window by design; the rest must not.
KEPT_RECORDS = {"sessions", "tracked_sessions"}


@pytest.fixture
async def kvgate_over_long_replies(tmp_path):
    """(URL, log path) of `kvgate serve` (access log and admin API on, gate defaults) over
    one simulated replica whose replies are long."""
    async with ServerGroup(tmp_path / "logs") as servers:
        replica_args = ["replica", "--name", "r0", "--host", "127.0.0.1", *LONG_REPLIES]
        replica = await servers.start_module("replica", "kvgate.cli", replica_args)
        config = {
            "replicas": [{"name": "r0", "url": replica}],
            "log": {"access": True},
            "admin": {"token": ADMIN_TOKEN},
        }
        url = await servers.serve("kvgate", lambda port: {**config, "listen": {"host": "127.0.0.1", "port": port}})
        yield url, tmp_path / "logs" / "kvgate.log"


async def admin_state(url: str) -> dict:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(url + "/admin/state", headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def interrupt_once_streaming(proc: asyncio.subprocess.Process) -> None:
    """Read `claude -p --output-format stream-json --include-partial-messages` events until
    the first text delta of the reply (the turn is streaming), then send SIGINT."""
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        assert line, "claude ended before its turn streamed"
        event = json.loads(line)
        if event.get("type") == "stream_event" and event["event"]["type"] == "content_block_delta":
            break
    proc.send_signal(signal.SIGINT)


async def test_claude_code_interrupted_mid_stream_leaves_nothing(kvgate_over_long_replies, tmp_path):
    executable = await asyncio.to_thread(ensure_npm_client, "@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")
    url, log_path = kvgate_over_long_replies
    workdir, home = task_folder(tmp_path / "task"), tmp_path / "home"
    home.mkdir()
    env = client_env(
        ("ANTHROPIC_", "CLAUDE_"), **QUIET_ENV, HOME=str(home), ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="sk-unused"
    )
    session_id = str(uuid.uuid4())
    stream = ["--output-format", "stream-json", "--verbose", "--include-partial-messages"]
    tools = ["--tools", READ_ONLY_TOOLS, "--allowedTools", READ_ONLY_TOOLS]
    command = [str(executable), "-p", "list the files here", "--session-id", session_id, *tools, *stream]
    proc = await asyncio.create_subprocess_exec(
        *command, "--model", "kvgate-sim", cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await interrupt_once_streaming(proc)
        await asyncio.wait_for(proc.communicate(), timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    # The turn ended when the client left; its window, now idle, lives out its quiet lifetime.
    ((gate_state,),) = [list((await admin_state(url))["gates"].values())]
    ((session,),) = [list(gate_state["sessions"].values())]
    await asyncio.sleep(session["quiet_lifetime_sec"] + 1.0)
    state = await admin_state(url)
    leaks = {key: count for key, count in leaks_of(state).items() if key not in KEPT_RECORDS}
    assert leaks == {}, state
    (session,) = state["gates"]["r0"]["sessions"].values()
    assert session["last_window_end"] == "quiet" and not session["has_window"], session

    records = access_records(log_path.read_text())
    assert [(r["route"], r["status"]) for r in records] == [("messages", "499")], records
    assert records[0]["session"] != "-" and records[0]["admission"] == "window_fits", records
