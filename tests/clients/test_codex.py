"""Codex CLI (`codex exec`, npm `@openai/codex`, installed into the kvgate cache) runs
one session of five prompts through `kvgate serve` on the embedded default, as a custom
Responses provider with a read-only sandbox (docs/clients.md has the same setup). From
kvgate's access log: every turn is in the session, on one replica, holding its window,
and nothing fails."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from client_harness import NO_NETWORK_ENV, access_records, ensure_npm_client, session_turns

pytestmark = [
    pytest.mark.clients,
    pytest.mark.skipif(shutil.which("npm") is None, reason="npm is needed to install Codex CLI"),
]

CODEX_VERSION = "0.171.0"
# One turn each at least (more when the reply calls a tool): five prompts make five turns.
PROMPTS = (
    "list the files here",
    "read README.md and summarise it",
    "which file is the entry point?",
    "what does main.py print?",
    "summarise what you found",
)
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
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))},
        **NO_NETWORK_ENV,
        "HOME": str(codex_home.parent),
        "CODEX_HOME": str(codex_home),
        "KVGATE_CLIENT_KEY": "unused",
    }
    proc = await asyncio.create_subprocess_exec(
        str(executable),
        "exec",
        "--json",
        "--skip-git-repo-check",
        "--sandbox",
        "read-only",
        *args,
        cwd=workdir,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, (out.decode()[-2000:], err.decode()[-2000:])
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


async def test_codex_session_runs_through_kvgate(embedded_kvgate, tmp_path):
    executable = await asyncio.to_thread(ensure_npm_client, "@openai/codex", CODEX_VERSION, "codex")
    url, log_path = embedded_kvgate
    workdir, codex_home = tmp_path / "task", tmp_path / "home" / ".codex"
    workdir.mkdir()
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(CONFIG.format(base_url=url + "/v1"))
    (workdir / "README.md").write_text("# demo\nA tiny project: main.py prints a greeting.\n")
    (workdir / "main.py").write_text("print('hello')\n")
    started = time.monotonic()
    events = await codex(executable, workdir, codex_home, PROMPTS[0])
    (thread_id,) = [event["thread_id"] for event in events if event["type"] == "thread.started"]
    for prompt in PROMPTS[1:]:
        events += await codex(executable, workdir, codex_home, "resume", thread_id, prompt)
    elapsed = time.monotonic() - started
    assert not [event for event in events if event["type"] in ("turn.failed", "error")], events
    await asyncio.sleep(0.2)  # the last access lines are written as the answers end
    records = access_records(log_path.read_text())
    turns = session_turns(records, "responses")
    assert "-" not in turns, "an anonymous turn"
    ((session, session_records),) = turns.items()  # one session: every prompt resumed the thread
    assert len(session_records) >= len(PROMPTS), session_records
    assert len({record["replica"] for record in session_records}) == 1, session_records
    admissions = [record["admission"] for record in session_records]
    assert admissions[0] == "window_fits" and set(admissions) <= {"window_fits", "holds_window"}, admissions
    # as for Claude Code: a new `codex exec` process may start after the idle window ended
    assert admissions.count("holds_window") >= len(admissions) - len(PROMPTS), admissions
    assert all(record["status"] == "200" for record in records), [r for r in records if r["status"] != "200"]
    tools = [
        e["item"]["type"] for e in events if e["type"] == "item.completed" and e["item"]["type"] != "agent_message"
    ]
    print(f"codex: {len(session_records)} turns over {len(PROMPTS)} prompts in {elapsed:.1f}s; items {tools}")
