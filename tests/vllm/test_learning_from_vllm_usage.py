"""The gate learns each turn's prompt from vLLM's own usage, on the real vLLM CPU server
(started with --enable-prompt-tokens-details, as docs/vllm-plugin.md says):

- a streamed turn whose client did not ask for its usage is relayed with no usage event,
  as vLLM streams it to a client that did not ask;
- kvgate asked for it upstream all the same, and learned the turn's exact prompt size:
  after vLLM's prefix cache is emptied, the session's next turn is counted as
  re-prefilling the whole of that prompt (full blocks) in
  `kvgate_reprefill_tokens_estimated_total`, with no prefix probe made for that turn.
"""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from server_calls import words
from vllm_harness import KvgateProxy, free_port, http_json

pytestmark = pytest.mark.vllm

MODEL = "tiny"
ADMIN_TOKEN = "usage-learning-admin"


def kvgate_metric(url: str, name: str, label: str = "") -> float:
    """The sum of kvgate's samples named exactly `name` (with `label`, e.g. 'probe="prefix"',
    among their labels); 0 when there are none."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.split("{")[0].split(" ")[0] == name and label in line
    )


def gate_state(url: str) -> dict:
    """Replica v0's gate in kvgate's /admin/state."""
    status, state = http_json("GET", url + "/admin/state", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200, state
    return state["gates"]["v0"]


def settled_gate(url: str) -> dict:
    """The gate's state once it holds no lease. It learns a turn's usage before it gives the
    turn's lease back, which may come after the client has read the stream's end."""
    gate = gate_state(url)
    deadline = time.monotonic() + 30
    while gate["leases"] and time.monotonic() < deadline:
        time.sleep(0.05)
        gate = gate_state(url)
    return gate


def prefix_probes(url: str) -> float:
    """The prefix probes kvgate has made."""
    return kvgate_metric(url, "kvgate_probe_seconds_count", 'probe="prefix"')


def streamed(client: openai.OpenAI, messages: list[dict], **options) -> list[dict]:
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0.0, stream=True, **options
    )
    return [chunk.model_dump() for chunk in stream]


def content(chunks: list[dict]) -> list[tuple[str | None, str | None]]:
    """What a client reads from a stream: each choice's text and finish reason, in order."""
    return [(c["delta"].get("content"), c["finish_reason"]) for chunk in chunks for c in chunk["choices"]]


def test_a_stream_without_usage_is_relayed_as_sent_and_teaches_the_gate(vllm_server, tmp_path):
    config = tmp_path / "kvgate.yaml"
    proxy = KvgateProxy(config_path=config, log_path=tmp_path / "kvgate.log", port=free_port())
    KvgateProxy.write_config(config, proxy.port, vllm_server.url, {"mode": "enforce", "policy": "working_set"})
    with config.open("a") as text:
        text.write(f"admin: {{token: {ADMIN_TOKEN}}}\n")
    first = [
        {"role": "system", "content": "You are agent. " + words(30, "usage-system")},
        {"role": "user", "content": "Task: " + words(40, "usage-task")},
    ]
    direct = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="k", max_retries=0)
    # the first turn's prompt size, as vLLM counts it (a JSON answer always carries usage)
    prompt_tokens = direct.chat.completions.create(model=MODEL, messages=first, max_tokens=1).usage.prompt_tokens
    reference = streamed(direct, first)
    proxy.start()
    try:
        via = openai.OpenAI(
            base_url=proxy.url + "/v1", api_key="k", max_retries=0, default_headers={"x-session-id": "usage-learning"}
        )
        vllm_server.reset_prefix_cache()
        got = streamed(via, first)
        assert got and all(chunk["usage"] is None and chunk["choices"] for chunk in got), got[-2:]
        assert content(got) == content(reference)
        assert all(chunk["usage"] is None for chunk in reference)  # vLLM sends none unasked

        assert settled_gate(proxy.url)["leases"] == 0  # the first turn's usage is learned
        vllm_server.reset_prefix_cache()  # the session's prefix is gone: its next turn prefills it again
        probes_before_second = prefix_probes(proxy.url)  # the first turn's: repriced beside it, nothing learned yet
        second = first + [
            {"role": "assistant", "content": "".join(text or "" for text, _ in content(got))},
            {"role": "user", "content": "Tool result: " + words(30, "usage-tool")},
        ]
        answer = streamed(via, second, stream_options={"include_usage": True})
        usage = answer[-1]["usage"]  # a client that asks gets its usage event, as from vLLM
        assert answer[-1]["choices"] == [] and usage["prompt_tokens_details"]["cached_tokens"] == 0

        gate = settled_gate(proxy.url)
        assert (gate["leases"], gate["pending"], gate["pending_anonymous"]) == (0, [], 0)
        block = vllm_server.block_size
        assert kvgate_metric(proxy.url, "kvgate_reprefill_tokens_estimated_total") == prompt_tokens // block * block
        assert prefix_probes(proxy.url) == probes_before_second  # the second turn was priced by its usage
        via.close()
    finally:
        proxy.stop()
        direct.close()
