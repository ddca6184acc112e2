"""Agent APIs on the real vLLM CPU server: Anthropic messages and OpenAI Responses turns,
with the official SDKs, and the probe exact for both bodies.

Exact means: probed right before a turn with the turn's own body, `total_tokens` is the
prompt vLLM reports in the turn's usage, and `hit_tokens` is what vLLM's prefix cache
then hit for that turn (the delta of `vllm:prefix_cache_hits_total`; queries likewise).
The server runs with VLLM_ENABLE_RESPONSES_API_STORE=1 (the harness sets it), without
which vLLM keeps no state for `previous_response_id`.
"""

from __future__ import annotations

import sys

import anthropic
import openai
import pytest
from server_calls import anthropic_prompt, probe_prefix, settled_counters, words
from vllm_harness import REPO_ROOT, KvgateProxy, free_port, start_service, stop_process_group

pytestmark = pytest.mark.vllm

MODEL = "tiny"
TOOLS = [
    {
        "name": "read_file",
        "description": "read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]


def exact_turn(server, kind: str, body: dict, send) -> tuple[dict, object]:
    """Probe `body`, then send it; assert the probe named the very prompt and hits of the turn."""
    reading = probe_prefix(server, {kind: body})
    queries_before, hits_before = settled_counters(server)
    result = send()
    queries_after, hits_after = settled_counters(server)
    assert queries_after - queries_before == reading["total_tokens"]
    assert hits_after - hits_before == reading["hit_tokens"]
    return reading, result


def test_anthropic_messages_create_stream_and_tool_use_are_probed_exactly(vllm_server):
    vllm_server.reset_prefix_cache()
    client = anthropic.Anthropic(base_url=vllm_server.url, api_key="k", max_retries=0)
    history = [{"role": "user", "content": "Task: " + words(60, "cc-task")}]
    for turn in range(1, 4):
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "system": "You are agent. " + words(40, "cc-system"),
            "messages": history,
        }
        reading, message = exact_turn(vllm_server, "messages", body, lambda body=body: client.messages.create(**body))
        assert reading["total_tokens"] == anthropic_prompt(message.usage)
        if turn > 1:
            assert reading["hit_tokens"] > 0
        history = history + [
            {"role": "assistant", "content": message.content[0].text},
            {"role": "user", "content": "Tool result: " + words(40, f"cc-tool-{turn}")},
        ]

    body = {"model": MODEL, "max_tokens": 4, "messages": history}

    def stream():
        with client.messages.stream(**body) as events:
            return events.get_final_message()

    reading, final = exact_turn(vllm_server, "messages", body, stream)
    assert reading["total_tokens"] == anthropic_prompt(final.usage) and final.content[0].type == "text"

    # Tool use: definitions, a tool_use block and its tool_result. The server has no tool
    # parser, so the test asks for no new tool call (tool_choice none), as vLLM requires.
    tool_history = history + [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "kvgate.yaml"}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": words(30, "cc-tool-result")}],
        },
    ]
    body = {"model": MODEL, "max_tokens": 4, "tools": TOOLS, "tool_choice": {"type": "none"}, "messages": tool_history}
    reading, message = exact_turn(vllm_server, "messages", body, lambda: client.messages.create(**body))
    assert reading["total_tokens"] == anthropic_prompt(message.usage)
    client.close()


def test_responses_create_stream_and_a_previous_response_id_chain_are_probed_exactly(vllm_server):
    vllm_server.reset_prefix_cache()
    client = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="k", max_retries=0)
    instructions = "You are agent. " + words(40, "resp-system")
    body = {
        "model": MODEL,
        "instructions": instructions,
        "input": "Task: " + words(60, "resp-task"),
        "max_output_tokens": 4,
    }
    reading, response = exact_turn(vllm_server, "responses", body, lambda: client.responses.create(**body))
    assert reading["total_tokens"] == response.usage.input_tokens
    for turn in range(2, 5):
        body = {
            "model": MODEL,
            "instructions": instructions,
            "previous_response_id": response.id,
            "input": [{"role": "user", "content": "Tool result: " + words(40, f"resp-tool-{turn}")}],
            "max_output_tokens": 4,
        }
        if turn == 4:

            def send(body=body):
                with client.responses.stream(**body) as events:
                    return events.get_final_response()
        else:

            def send(body=body):
                return client.responses.create(**body)

        reading, response = exact_turn(vllm_server, "responses", body, send)
        assert reading["total_tokens"] == response.usage.input_tokens
        assert reading["hit_tokens"] > 0  # the stored conversation is this turn's cached prefix
    # a response this server does not hold: vLLM's own 404, and the probe says so too
    missing = {"model": MODEL, "input": "x", "previous_response_id": "resp_never_made"}
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**missing)
    from vllm_harness import http_json

    status, error = http_json("POST", vllm_server.url + "/v1/kvgate/prefix", {"responses": missing})
    assert status == 404 and error["error"]["param"] == "responses.previous_response_id"
    client.close()


@pytest.fixture
def vllm_and_simulated_behind_kvgate(vllm_server, tmp_path):
    """kvgate (working_set policy, enforcing) in front of the vLLM server and a simulated replica."""
    sim_port = free_port()
    sim = start_service(
        [sys.executable, "-m", "kvgate.cli", "replica", "--port", str(sim_port)],
        tmp_path / "sim.log",
        f"http://127.0.0.1:{sim_port}/health",
        60,
        0.3,
        "simulated replica",
        cwd=REPO_ROOT,
    )
    proxy = None
    try:
        port = free_port()
        config = tmp_path / "kvgate.yaml"
        config.write_text(
            f"listen: {{host: 127.0.0.1, port: {port}}}\n"
            "replicas:\n"
            f"  - {{name: v0, url: '{vllm_server.url}'}}\n"
            f"  - {{name: sim, url: 'http://127.0.0.1:{sim_port}'}}\n"
            "gate: {mode: enforce, policy: working_set}\n"
        )
        proxy = KvgateProxy(config, tmp_path / "kvgate.log", port).start()
        yield proxy
    finally:
        if proxy is not None:
            proxy.stop()
        stop_process_group(sim, grace=10)


def test_chains_through_kvgate_stay_on_the_replica_that_holds_them(vllm_and_simulated_behind_kvgate):
    """Anonymous chains spread over the two replicas; every continuation reaches the one
    that produced its previous response (the other would answer 404)."""
    client = openai.OpenAI(base_url=vllm_and_simulated_behind_kvgate.url + "/v1", api_key="k", max_retries=0)
    chains = []
    for index in range(6):
        raw = client.responses.with_raw_response.create(
            model=MODEL, input="Task: " + words(30, f"chain-{index}"), max_output_tokens=3
        )
        chains.append((raw.parse().id, raw.headers["x-kvgate-replica"]))
    assert {replica for _, replica in chains} == {"v0", "sim"}
    for turn in range(2, 4):
        for index, (previous_id, replica) in enumerate(chains):
            headers = {"x-session-finish": "true"} if turn == 3 else None
            raw = client.responses.with_raw_response.create(
                model=MODEL,
                previous_response_id=previous_id,
                input="Tool result: " + words(20, (index, turn)),
                max_output_tokens=3,
                extra_headers=headers,
            )
            assert raw.headers["x-kvgate-replica"] == replica
            assert raw.headers["x-kvgate-admission"] in ("window_fits", "holds_window")
            chains[index] = (raw.parse().id, replica)
    client.close()


def test_count_tokens_and_responses_retrieve_reach_the_real_vllm_through_kvgate(
    vllm_server, vllm_and_simulated_behind_kvgate
):
    """The routes agent clients call besides generation, ungated: Claude Code's count_tokens
    (its session in `x-claude-code-session-id` only) reaches the session's replica, and
    vLLM counts what it would prefill; a stored response is retrieved from the vLLM server
    that holds it, whichever session asks."""
    url = vllm_and_simulated_behind_kvgate.url
    messages = [{"role": "user", "content": "Count me: " + words(25, "count-tokens")}]
    direct = anthropic.Anthropic(base_url=vllm_server.url, api_key="k", max_retries=0)
    expected = direct.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    on_vllm = 0
    for index in range(8):
        client = anthropic.Anthropic(
            base_url=url, api_key="k", max_retries=0, default_headers={"x-claude-code-session-id": f"cc-{index}"}
        )
        first = client.messages.with_raw_response.count_tokens(model=MODEL, messages=messages)
        again = client.messages.with_raw_response.count_tokens(model=MODEL, messages=messages)
        assert first.headers["x-kvgate-replica"] == again.headers["x-kvgate-replica"]  # the session's replica
        assert "x-kvgate-admission" not in first.headers  # never gated
        if first.headers["x-kvgate-replica"] == "v0":
            on_vllm += 1
            assert first.parse().input_tokens == expected
        client.close()
    assert on_vllm > 0
    direct.close()

    openai_client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    stored = []
    for index in range(6):
        raw = openai_client.responses.with_raw_response.create(
            model=MODEL, input="Store me: " + words(10, f"retrieve-{index}"), max_output_tokens=3
        )
        stored.append((raw.parse(), raw.headers["x-kvgate-replica"]))
    assert "v0" in {replica for _, replica in stored}
    for response, replica in stored:
        raw = openai_client.responses.with_raw_response.retrieve(response.id, extra_headers={"x-session-id": "other"})
        assert raw.headers["x-kvgate-replica"] == replica
        assert raw.parse().id == response.id
        if replica == "v0":
            assert raw.parse().output_text == response.output_text
    openai_client.close()
