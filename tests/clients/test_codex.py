"""Codex CLI (`codex exec`, npm `@openai/codex`, installed into the kvgate cache) runs
one session of five prompts through `kvgate serve` on the embedded default, as a custom
Responses provider with a read-only sandbox (docs/clients.md has the same setup). From
kvgate's access log: every turn is in the session, on one replica, holding its window,
and nothing fails.

Side routes: Codex CLI 0.171.0 sends kvgate nothing but `/v1/responses` with this
config (no `/v1/models`); the test asserts that any side request it does send is
forwarded in the session to the session's replica, answered 200."""

from __future__ import annotations

import asyncio
import json
import time
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

pytestmark = NPM_CLIENT

CODEX_VERSION = "0.171.0"
CONFIG = """model = "kvgate-sim"
model_provider = "kvgate"

[model_providers.kvgate]
name = "kvgate"
base_url = "{base_url}"
env_key = "KVGATE_CLIENT_KEY"
wire_api = "responses"
"""


async def codex(executable: Path, workdir: Path, codex_home: Path, *args: str) -> list[dict]:
    """One `codex exec --json` run; its JSON events."""
    env = client_env(
        ("OPENAI_", "CODEX_"), HOME=str(codex_home.parent), CODEX_HOME=str(codex_home), KVGATE_CLIENT_KEY="unused"
    )
    command = [str(executable), "exec", "--json", "--skip-git-repo-check", "--sandbox", "read-only", *args]
    out = await run_client(command, workdir, env)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


async def test_codex_session_runs_through_kvgate(embedded_kvgate, recorded_kvgate, tmp_path):
    executable = await asyncio.to_thread(ensure_npm_client, "@openai/codex", CODEX_VERSION, "codex")
    url, log_path, requests = recorded_kvgate
    workdir, codex_home = task_folder(tmp_path / "task"), tmp_path / "home" / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(CONFIG.format(base_url=url + "/v1"))
    started = time.monotonic()
    events = await codex(executable, workdir, codex_home, PROMPTS[0])
    (thread_id,) = [event["thread_id"] for event in events if event["type"] == "thread.started"]
    for prompt in PROMPTS[1:]:
        events += await codex(executable, workdir, codex_home, "resume", thread_id, prompt)
    elapsed = time.monotonic() - started
    assert not [event for event in events if event["type"] in ("turn.failed", "error")], events
    await asyncio.sleep(0.2)  # the last access lines are written as the answers end
    all_records = access_records(log_path.read_text())
    assert_every_request_forwarded(requests, all_records)
    records = assert_one_session_of_prompts(all_records, "responses", len(PROMPTS))
    tools = [
        e["item"]["type"] for e in events if e["type"] == "item.completed" and e["item"]["type"] != "agent_message"
    ]
    # As Claude Code's (test_claude_code.py): the first run's last reply, a message without
    # a function call, ended the window; the resumed run came back in time and kept it after.
    ends, sessions = await gate_sessions(embedded_kvgate[0])
    ((session,),) = [list(sessions.values())]
    assert ends["final_reply"] == 1 and session["goes_on_after_reply"], (ends, sessions)
    print(f"codex: {len(records)} turns over {len(PROMPTS)} prompts in {elapsed:.1f}s; items {tools}")
