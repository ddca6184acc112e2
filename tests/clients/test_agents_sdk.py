"""The OpenAI Agents SDK (`openai-agents`, installed into the kvgate cache) runs
multi-turn sessions with tools through `kvgate serve` on the embedded default
(docs/clients.md has the same setup). From kvgate's access log: every turn is in its
session, each session stays on one replica, later turns hold their window, and nothing
fails: every request the SDK sends is forwarded and answered 200 (it sends only its
generation route)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from client_harness import (
    access_records,
    assert_all_ok,
    assert_every_request_forwarded,
    assert_session_turns,
    client_env,
    ensure_python_client,
    gate_sessions,
    run_client,
    session_turns,
    task_folder,
)

pytestmark = pytest.mark.clients

AGENTS_SDK = "openai-agents==0.24.0"
SCRIPT = Path(__file__).parent / "scripts" / "agents_sdk_task.py"


async def run_session(python: Path, base_url: str, workdir: Path, session_id: str, api: str) -> dict:
    command = [str(python), str(SCRIPT), base_url, str(workdir), session_id, api]
    out = await run_client(command, workdir, client_env(("OPENAI_",)), timeout=240)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("api, route", [("responses", "responses"), ("chat", "chat")])
async def test_agents_sdk_sessions_run_through_kvgate(embedded_kvgate, recorded_kvgate, tmp_path, api, route):
    python = await asyncio.to_thread(ensure_python_client, AGENTS_SDK)
    url, log_path, requests = recorded_kvgate
    workdir = task_folder(tmp_path / "task")
    results = await asyncio.gather(
        *(run_session(python, url + "/v1", workdir, f"agents-{api}-{index}", api) for index in range(2))
    )
    for result in results:
        assert result["model_calls"] >= 5 and len(result["tool_calls"]) >= 3, result
    await asyncio.sleep(0.2)  # the last access lines are written as the answers end
    records = access_records(log_path.read_text())
    assert_every_request_forwarded(requests, records)
    turns = session_turns(records, route)
    assert "-" not in turns, "an anonymous turn"
    assert len(turns) == 2
    for session_records in turns.values():
        assert_session_turns(session_records, 5)
    assert_all_ok(records)
    assert sum(len(r) for r in turns.values()) == sum(result["model_calls"] for result in results)
    # Each run ended on its final output, a reply without a tool call: that ended its window.
    ends, sessions = await gate_sessions(embedded_kvgate[0])
    assert ends["final_reply"] == 2 and all(s["last_window_end"] == "final_reply" for s in sessions.values()), sessions
