"""Claude Code (`claude -p`, npm `@anthropic-ai/claude-code`, installed into the kvgate
cache) runs one session of five prompts with its read-only tools through `kvgate serve`
on the embedded default (docs/clients.md has the same setup). From kvgate's access log:
every turn is in the session, on one replica, the later ones holding its window, and
nothing fails. From the gate's books: the session's window is priced at the replies it
got, far below the `max_tokens` Claude Code caps every turn with.

Side routes: with non-essential traffic off (QUIET_ENV), Claude Code 2.1.332 sends
kvgate nothing but `/v1/messages` (no `count_tokens`); the test asserts that any side
request it does send is forwarded in the session to the session's replica, answered 200."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

from client_harness import (
    NPM_CLIENT,
    PROMPTS,
    access_records,
    assert_every_request_forwarded,
    assert_one_session_of_prompts,
    client_env,
    ensure_npm_client,
    gate_sessions,
    run_client,
    task_folder,
)

from kvgate.simulator.config import EngineConfig

pytestmark = NPM_CLIENT

CLAUDE_CODE_VERSION = "2.1.332"
READ_ONLY_TOOLS = "Read,Glob,Grep"
# No telemetry, error reports, update checks or other traffic beyond the model's API.
QUIET_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}


async def claude(executable: Path, base_url: str, workdir: Path, home: Path, prompt: str, *session: str) -> dict:
    """One `claude -p` run; its JSON result."""
    env = client_env(
        ("ANTHROPIC_", "CLAUDE_"),
        **QUIET_ENV,
        HOME=str(home),
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="sk-unused",
    )
    # --tools offers only the read-only tools; --allowedTools lets them run without asking
    tools = ["--tools", READ_ONLY_TOOLS, "--allowedTools", READ_ONLY_TOOLS]
    command = [str(executable), "-p", prompt, *session, *tools, "--model", "kvgate-sim", "--output-format", "json"]
    return json.loads(await run_client(command, workdir, env))


async def test_claude_code_session_runs_through_kvgate(embedded_kvgate, recorded_kvgate, tmp_path):
    executable = await asyncio.to_thread(ensure_npm_client, "@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")
    url, log_path, requests = recorded_kvgate
    workdir, home = task_folder(tmp_path / "task"), tmp_path / "home"
    home.mkdir()
    session_id = str(uuid.uuid4())
    started = time.monotonic()
    results = [await claude(executable, url, workdir, home, PROMPTS[0], "--session-id", session_id)]
    for prompt in PROMPTS[1:]:
        results.append(await claude(executable, url, workdir, home, prompt, "--resume", session_id))
    elapsed = time.monotonic() - started
    for result in results:
        assert not result["is_error"] and result["session_id"] == session_id, result
    await asyncio.sleep(0.2)  # the last access lines are written as the answers end
    all_records = access_records(log_path.read_text())
    assert_every_request_forwarded(requests, all_records)
    records = assert_one_session_of_prompts(all_records, "messages", len(PROMPTS))
    assert len(records) >= sum(result["num_turns"] for result in results)
    # The first run ended on a reply without a tool call, and that ended the window
    # (`final_reply`); the next run came back before it would have gone quiet, so the
    # session goes on after final replies and its later ones kept the window.
    ends, sessions = await gate_sessions(embedded_kvgate[0])
    assert ends["final_reply"] == 1 and sessions[session_id]["goes_on_after_reply"], (ends, sessions)
    # It moves its prompt-caching mark to its newest message every turn: every turn's body
    # still continues the one thread of its history (`request_body.rendered_item`)
    assert sessions[session_id]["threads"] == 1, sessions[session_id]
    # Claude Code caps its replies far above their length: the session's window is priced at
    # the replies the replica gave, not at the cap (docs/decisions/output-priced-at-recent-replies.md)
    cap = min(r.max_tokens for r in requests if r.path == "/v1/messages" and r.max_tokens is not None)
    window = sessions[session_id]["footprint_blocks"]
    assert window * EngineConfig.block_size < cap, (cap, sessions[session_id])
    print(f"claude code: {len(records)} turns over {len(PROMPTS)} prompts in {elapsed:.1f}s", end="; ")
    print(f"max_tokens {cap}, window {window} blocks")
