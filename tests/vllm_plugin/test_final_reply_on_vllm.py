"""A reply that ends an agent's run ends its window and its KV pin, on the real vLLM CPU
server: the session's keyed server (conftest.keyed_server: the retention connector, and
vLLM's auto tool choice with the `pythonic` parser, so a request may leave the tool choice
to the model). kvgate pins each session's window in the engine; a turn whose reply the
model ended without a tool call (a stop string: finish reason `stop`, Anthropic's
`stop_sequence`) releases its session's pin at once, streamed or not, while a reply cut
at `max_tokens` keeps it.
"""

from __future__ import annotations

import time

import anthropic
import openai
import pytest
from keyed_server import GATE, REPLICA_KEY, VLLM_KEY
from server_calls import words
from vllm_harness import KvgateProxy, VllmServer, free_port, http_json

from kvgate.wire.probe_api import KV_PATH

pytestmark = pytest.mark.vllm

MODEL = "tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
# The random model's text meets one of these within a few tokens: its reply ends `stop`.
STOPS = [" ", "e", "a", "t"]  # at most 4, as the OpenAI API allows


def pinned_sessions(server: VllmServer) -> int:
    status, kv = http_json("GET", server.url + KV_PATH, headers=GATE)
    assert status == 200, kv
    return kv["num_pinned_sessions"]


def until_pinned(server: VllmServer, count: int, timeout: float = 10.0) -> int:
    """The server's pinned sessions once they are `count` (a pin is kept as its request
    finishes, and released by the gate's call after the answer), or as they are at `timeout`."""
    deadline = time.monotonic() + timeout
    while (pinned := pinned_sessions(server)) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return pinned


def test_a_final_reply_releases_the_sessions_pin_and_a_cut_one_keeps_it(keyed_server, tmp_path):
    keyed_server.reset_prefix_cache()
    config = tmp_path / "kvgate.yaml"
    proxy = KvgateProxy(config_path=config, log_path=tmp_path / "kvgate.log", port=free_port())
    gate = {"mode": "enforce", "policy": "working_set", "pins": "auto", "probe": {"timeout_sec": 5.0}}
    KvgateProxy.write_config(
        config, proxy.port, keyed_server.url, gate, {"api_key": VLLM_KEY, "replica_api_key": REPLICA_KEY}
    )
    proxy.start()
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=120)

    def turn(session: str, stream: bool, finish: bool = False, **fields) -> str:
        headers = {"x-session-id": session, **({"x-session-finish": "true"} if finish else {})}
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{session}: " + words(60, session)}],
            tools=TOOLS,
            extra_headers=headers,
            stream=stream,
            **fields,
        )
        if not stream:
            return answer.choices[0].finish_reason
        reasons = [chunk.choices[0].finish_reason for chunk in answer if chunk.choices]
        return next(reason for reason in reasons if reason is not None)

    try:
        assert pinned_sessions(keyed_server) == 0
        # cut at its cap: the agent may go on, so the window and its pin stay
        assert turn("cut", stream=False, max_tokens=4, extra_body={"ignore_eos": True}) == "length"
        assert until_pinned(keyed_server, 1) == 1, proxy.log_tail()
        for stream in (False, True):
            session = f"done-{stream}"
            assert turn(session, stream, max_tokens=64, stop=STOPS) == "stop"
            assert until_pinned(keyed_server, 1) == 1, proxy.log_tail()  # only "cut" is still pinned
        # vLLM's Anthropic messages route, streamed: the stream's message_delta says stop_sequence
        with anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0, timeout=120) as messages:
            with messages.messages.stream(
                model=MODEL,
                max_tokens=64,
                stop_sequences=STOPS,
                tools=[{"name": "read_file", "input_schema": TOOLS[0]["function"]["parameters"]}],
                messages=[{"role": "user", "content": "done-messages: " + words(60, "done-messages")}],
                extra_headers={"x-session-id": "done-messages"},
            ) as events:
                assert events.get_final_message().stop_reason == "stop_sequence"
        assert until_pinned(keyed_server, 1) == 1, proxy.log_tail()
        turn("cut", stream=False, finish=True, max_tokens=4, extra_body={"ignore_eos": True})
        assert until_pinned(keyed_server, 0) == 0, proxy.log_tail()
    finally:
        client.close()
        proxy.stop()
