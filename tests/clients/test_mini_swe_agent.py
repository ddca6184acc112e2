"""mini-swe-agent (`mini-swe-agent`, through litellm, installed into the kvgate cache)
runs a multi-turn task with its bash tool confined to read-only commands in a temporary
folder, through `kvgate serve` on the embedded default (docs/clients.md has the same
setup). From kvgate's access log: every turn is in the session, on one replica, the later
ones holding its window, and nothing fails.

Side routes: litellm sends kvgate nothing but `/v1/chat/completions`; any side request
it does send must be forwarded in the session to the session's replica, answered 200."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from client_harness import (
    access_records,
    assert_every_request_forwarded,
    assert_one_session_of_prompts,
    client_env,
    ensure_python_client,
    gate_sessions,
    run_client,
    task_folder,
)

pytestmark = pytest.mark.clients

MINI_SWE_AGENT = "mini-swe-agent==2.4.6"
SCRIPT = Path(__file__).parent / "scripts" / "mini_swe_agent_task.py"
STEPS = 6
# litellm reads its model price list from its own package, not from GitHub; mini-swe-agent
# keeps its global config in the test's folder and starts without its banner.
QUIET_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_SILENT_STARTUP": "1"}


async def test_mini_swe_agent_session_runs_through_kvgate(embedded_kvgate, recorded_kvgate, tmp_path):
    python = await asyncio.to_thread(ensure_python_client, MINI_SWE_AGENT)
    url, log_path, requests = recorded_kvgate
    workdir = task_folder(tmp_path / "task")
    env = client_env(
        ("OPENAI_", "LITELLM_", "MSWEA_"),
        **QUIET_ENV,
        MSWEA_GLOBAL_CONFIG_DIR=str(tmp_path / "mswea"),
        HOME=str(tmp_path),
    )
    command = [str(python), str(SCRIPT), url + "/v1", str(workdir), "mini-swe-agent-1", str(STEPS)]
    result = json.loads((await run_client(command, workdir, env, timeout=240)).strip().splitlines()[-1])
    # the step limit ends the run; at least one answer called the bash tool (the replica's
    # arguments are arbitrary strings, so the environment mostly refuses them)
    assert result["exit_status"] == "LimitsExceeded" and result["model_calls"] == STEPS, result
    assert result["commands"], result
    await asyncio.sleep(0.2)  # the last access lines are written as the answers end
    all_records = access_records(log_path.read_text())
    assert_every_request_forwarded(requests, all_records)
    records = assert_one_session_of_prompts(all_records, "chat", STEPS)
    assert len(records) == STEPS, records
    # It asks the model again after a reply without a tool call: the first such reply
    # ended the window, the next turn came back at once, and no later one ends another.
    ends, sessions = await gate_sessions(embedded_kvgate[0])
    assert ends["final_reply"] <= 1 and sessions["mini-swe-agent-1"]["goes_on_after_reply"] == bool(ends["final_reply"])
    print(f"mini-swe-agent: {len(records)} turns; commands {result['commands']}; final replies {ends['final_reply']}")
