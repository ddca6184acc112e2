"""A client killed mid-stream leaves nothing behind: Claude Code (`claude -p`) or Codex
CLI (`codex exec`) is sent SIGINT while its first turn streams through `kvgate serve`
(docs/clients.md has the same setup). Once the session's quiet expiry has passed,
kvgate's /admin/state holds no lease, window or waiter for it, and the access log shows
the turn ended with status 499 (the client left), not a 5xx.

The replica is a simulated one whose replies run ~20,000 tokens (about two minutes at
time scale 1; the clients' `max_tokens` caps them higher, or they send none), so that
the turn is still streaming when the client is stopped; the gate runs its defaults."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from pathlib import Path

import pytest
from client_harness import (
    ADMIN_TOKEN,
    NPM_CLIENT,
    access_records,
    admin_state,
    client_env,
    ensure_npm_client,
    task_folder,
)
from test_claude_code import CLAUDE_CODE_VERSION, QUIET_ENV, READ_ONLY_TOOLS
from test_codex import CODEX_VERSION
from test_codex import CONFIG as CODEX_CONFIG

from kvgate.bench.processes import ServerGroup
from kvgate.bench.scale_out_load import leaks_of

pytestmark = NPM_CLIENT

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


async def claude_streaming(proc: asyncio.subprocess.Process, url: str) -> None:
    """Once `claude -p --output-format stream-json --include-partial-messages` printed the
    first text delta of its reply: the turn streams."""
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        assert line, "claude ended before its turn streamed"
        event = json.loads(line)
        if event.get("type") == "stream_event" and event["event"]["type"] == "content_block_delta":
            return


async def window_in_flight(proc: asyncio.subprocess.Process, url: str) -> None:
    """Once the gate has admitted the turn (a window in flight) and a second has passed:
    `codex exec --json` prints no deltas, and the replica streams from its first step."""
    for _ in range(600):
        assert proc.returncode is None, "the client ended before its turn was admitted"
        if any(gate["windows"]["in_flight"] for gate in (await admin_state(url))["gates"].values()):
            await asyncio.sleep(1.0)
            return
        await asyncio.sleep(0.1)
    raise AssertionError("no turn admitted within 60 s")


def claude_command(tmp_path: Path, url: str) -> tuple[list[str], dict[str, str]]:
    executable = ensure_npm_client("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")
    (tmp_path / "home").mkdir()
    env = client_env(
        ("ANTHROPIC_", "CLAUDE_"), **QUIET_ENV, HOME=str(tmp_path / "home"), ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY="sk-unused",
    )  # fmt: skip
    stream = ["--output-format", "stream-json", "--verbose", "--include-partial-messages"]
    tools = ["--tools", READ_ONLY_TOOLS, "--allowedTools", READ_ONLY_TOOLS, "--model", "kvgate-sim"]
    return [str(executable), "-p", "list the files here", "--session-id", str(uuid.uuid4()), *tools, *stream], env


def codex_command(tmp_path: Path, url: str) -> tuple[list[str], dict[str, str]]:
    executable = ensure_npm_client("@openai/codex", CODEX_VERSION, "codex")
    codex_home = tmp_path / "home" / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=url + "/v1"))
    env = client_env(
        ("OPENAI_", "CODEX_"), HOME=str(codex_home.parent), CODEX_HOME=str(codex_home), KVGATE_CLIENT_KEY="unused"
    )
    args = ["exec", "--json", "--skip-git-repo-check", "--sandbox", "read-only", "list the files here"]
    return [str(executable), *args], env


# client: (its command and environment, when its turn streams, its generation route)
CLIENTS = {
    "claude-code": (claude_command, claude_streaming, "messages"),
    "codex": (codex_command, window_in_flight, "responses"),
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_client_interrupted_mid_stream_leaves_nothing(kvgate_over_long_replies, tmp_path, client):
    command_of, streaming, route = CLIENTS[client]
    url, log_path = kvgate_over_long_replies
    command, env = await asyncio.to_thread(command_of, tmp_path, url)
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=task_folder(tmp_path / "task"), env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await streaming(proc, url)
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.communicate(), timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    # The turn ended when the client left; its window, now idle, lives out its quiet lifetime.
    ((session,),) = [list(gate["sessions"].values()) for gate in (await admin_state(url))["gates"].values()]
    await asyncio.sleep(session["quiet_lifetime_sec"] + 1.0)
    state = await admin_state(url)
    leaks = {key: count for key, count in leaks_of(state).items() if key not in KEPT_RECORDS}
    assert leaks == {}, state
    (session,) = state["gates"]["r0"]["sessions"].values()
    assert session["last_window_end"] == "quiet" and not session["has_window"], session

    records = access_records(log_path.read_text())
    assert [(r["route"], r["status"]) for r in records] == [(route, "499")], records
    assert records[0]["session"] != "-" and records[0]["admission"] == "window_fits", records
