"""Claude Code (`claude -p`, npm `@anthropic-ai/claude-code`, installed into the kvgate
cache) runs one session of five prompts with its read-only tools through `kvgate serve`
on the embedded default (docs/clients.md has the same setup). From kvgate's access log:
every turn is in the session, on one replica, holding its window, and nothing fails."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
from client_harness import NO_NETWORK_ENV, access_records, ensure_npm_client, session_turns

pytestmark = [
    pytest.mark.clients,
    pytest.mark.skipif(shutil.which("npm") is None, reason="npm is needed to install Claude Code"),
]

CLAUDE_CODE_VERSION = "2.1.332"
# One turn each at least (more when the reply calls a tool): five prompts make five turns.
PROMPTS = (
    "list the files here",
    "read README.md and summarise it",
    "which file is the entry point?",
    "what does main.py print?",
    "summarise what you found",
)
READ_ONLY_TOOLS = "Read,Glob,Grep"
# No telemetry, error reports, update checks or other traffic beyond the model's API.
QUIET_ENV = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
}


async def claude(executable: Path, base_url: str, workdir: Path, home: Path, prompt: str, *session: str) -> dict:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))},
        **NO_NETWORK_ENV,
        **QUIET_ENV,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-unused",
    }
    # --tools offers only the read-only tools; --allowedTools lets them run without asking
    args = ["-p", prompt, *session, "--tools", READ_ONLY_TOOLS, "--allowedTools", READ_ONLY_TOOLS]
    proc = await asyncio.create_subprocess_exec(
        str(executable),
        *args,
        "--model",
        "kvgate-sim",
        "--output-format",
        "json",
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
    return json.loads(out.decode())


async def test_claude_code_session_runs_through_kvgate(embedded_kvgate, tmp_path):
    executable = await asyncio.to_thread(ensure_npm_client, "@anthropic-ai/claude-code", CLAUDE_CODE_VERSION, "claude")
    url, log_path = embedded_kvgate
    workdir, home = tmp_path / "task", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    (workdir / "README.md").write_text("# demo\nA tiny project: main.py prints a greeting.\n")
    (workdir / "main.py").write_text("print('hello')\n")
    session_id = str(uuid.uuid4())
    started = time.monotonic()
    results = [await claude(executable, url, workdir, home, PROMPTS[0], "--session-id", session_id)]
    for prompt in PROMPTS[1:]:
        results.append(await claude(executable, url, workdir, home, prompt, "--resume", session_id))
    elapsed = time.monotonic() - started
    for result in results:
        assert not result["is_error"] and result["session_id"] == session_id, result
    await asyncio.sleep(0.2)  # the last access lines are written as the answers end
    records = access_records(log_path.read_text())
    turns = session_turns(records, "messages")
    assert list(turns) != ["-"] and "-" not in turns, "an anonymous turn"
    ((session, session_records),) = turns.items()  # one session: every prompt resumed it
    assert len(session_records) >= 5, session_records
    assert len(session_records) >= sum(result["num_turns"] for result in results)
    assert len({record["replica"] for record in session_records}) == 1, session_records
    admissions = [record["admission"] for record in session_records]
    assert admissions[0] == "window_fits" and set(admissions) <= {"window_fits", "holds_window"}, admissions
    # Within a prompt the turns hold the window; each new `claude -p` process may take longer
    # to start than the idle window lasts before the session's gap is known (quiet_floor_sec).
    assert admissions.count("holds_window") >= len(admissions) - len(PROMPTS), admissions
    assert all(record["status"] == "200" for record in records), [r for r in records if r["status"] != "200"]
    print(f"claude code: {len(session_records)} turns over {len(PROMPTS)} prompts in {elapsed:.1f}s")
