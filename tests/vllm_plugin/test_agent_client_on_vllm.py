"""The OpenAI Agents SDK through kvgate in front of a real vLLM CPU server (the tiny
model): what the client sends, Responses and chat bodies with tools offered and a growing
history, is served by real vLLM, and kvgate keeps the session on its replica and its
window. tests/clients/ runs the same client, and Claude Code, Codex and mini-swe-agent, on
the embedded default; their system prompts (thousands of tokens) do not fit the tiny
model's 2,016-token context, so the Agents SDK is the client run here, on chat
completions: the random-weight model never ends a reply, so every reply stops at its cap,
which the SDK accepts from chat (`length`) but refuses from Responses (`incomplete`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvgate.bench.processes import ServerGroup
from tests.clients.client_harness import (
    access_records,
    assert_all_ok,
    assert_session_turns,
    client_env,
    ensure_python_client,
    run_client,
    session_turns,
)

pytestmark = [pytest.mark.vllm, pytest.mark.clients]

AGENTS_SDK = "openai-agents==0.24.0"
SCRIPT = Path(__file__).resolve().parents[1] / "clients" / "scripts" / "agents_sdk_plain_task.py"


async def test_agents_sdk_session_runs_through_kvgate_on_real_vllm(vllm_server, tmp_path):
    api, route = "chat", "chat"
    python = await asyncio.to_thread(ensure_python_client, AGENTS_SDK)
    config = {
        "replicas": [{"name": "v0", "url": vllm_server.url}],
        "log": {"access": True},
        "gate": {"quiet_floor_sec": 10},  # as tests/clients: a window outlasts a slow CPU step
    }
    session = "agents-on-vllm"
    async with ServerGroup(tmp_path / "logs") as servers:
        url = await servers.serve("kvgate", lambda port: {**config, "listen": {"host": "127.0.0.1", "port": port}})
        command = [str(python), str(SCRIPT), url + "/v1", session, api, vllm_server.served_model_name]
        out = await run_client(command, tmp_path, client_env(("OPENAI_",)), timeout=300)
        await asyncio.sleep(0.2)  # the last access lines are written as the answers end
        records = access_records((tmp_path / "logs" / "kvgate.log").read_text())
    assert json.loads(out.strip().splitlines()[-1])["model_calls"] == 5
    turns = session_turns(records, route)
    assert "-" not in turns and len(turns) == 1, turns  # no anonymous turn; one session (logged hashed)
    (session_records,) = turns.values()
    assert_session_turns(session_records, 5)
    assert_all_ok(records)
