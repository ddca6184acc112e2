"""The gate learns each turn's prompt from vLLM's own usage, on the real vLLM CPU server
(started with --enable-prompt-tokens-details, as docs/vllm-plugin.md says), for chat,
Anthropic messages and Responses turns:

- a streamed turn whose client did not ask for its usage is relayed with no usage event,
  as vLLM streams it to a client that did not ask;
- kvgate asked for it upstream all the same, and learned the turn's exact prompt size:
  after vLLM's prefix cache is emptied, the session's next turn is counted as
  re-prefilling the whole of that prompt (full blocks) in
  `kvgate_reprefill_tokens_estimated_total`, with no prefix probe made for that turn;
- a turn sent with a max_tokens far above its reply leaves a window priced at the reply
  vLLM's usage counted, not at the cap.
"""

from __future__ import annotations

import time
import urllib.request

import anthropic
import openai
import pytest
from server_calls import anthropic_prompt, words
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
    """The gate's state once it holds no lease and runs no repricing probe. It learns a
    turn's usage before it gives the turn's lease back, which may come after the client
    has read the stream's end; a probe pricing a turn's window runs beside the turn and
    may be answered after it ends (on a loaded machine)."""
    gate = gate_state(url)
    deadline = time.monotonic() + 30
    while (gate["leases"] or gate["repricing"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        gate = gate_state(url)
    return gate


def prefix_probes(url: str) -> float:
    """The prefix probes kvgate has made."""
    return kvgate_metric(url, "kvgate_probe_seconds_count", 'probe="prefix"')


def usage_proxy(vllm_server, tmp_path) -> KvgateProxy:
    """kvgate (not started) in front of the server, the working_set gate enforcing, its
    /admin/state open to ADMIN_TOKEN."""
    config = tmp_path / "kvgate.yaml"
    proxy = KvgateProxy(config_path=config, log_path=tmp_path / "kvgate.log", port=free_port())
    KvgateProxy.write_config(config, proxy.port, vllm_server.url, {"mode": "enforce", "policy": "working_set"})
    with config.open("a") as text:
        text.write(f"admin: {{token: {ADMIN_TOKEN}}}\n")
    return proxy


def streamed(client: openai.OpenAI, messages: list[dict], **options) -> list[dict]:
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0.0, stream=True, **options
    )
    return [chunk.model_dump() for chunk in stream]


def content(chunks: list[dict]) -> list[tuple[str | None, str | None]]:
    """What a client reads from a stream: each choice's text and finish reason, in order."""
    return [(c["delta"].get("content"), c["finish_reason"]) for chunk in chunks for c in chunk["choices"]]


def text_and_ends(chunks: list[dict]) -> tuple[str, list[str]]:
    """A stream's whole text and its finish reasons: what two streams of one greedy answer
    share, however vLLM cut the tokens into events (its output processor joins the tokens
    of several engine steps into one event when the stream lags, which timing decides)."""
    read = content(chunks)
    return "".join(text or "" for text, _ in read), [end for _, end in read if end is not None]


def test_a_stream_without_usage_is_relayed_as_sent_and_teaches_the_gate(vllm_server, tmp_path):
    proxy = usage_proxy(vllm_server, tmp_path)
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
        assert text_and_ends(got) == text_and_ends(reference)
        assert all(chunk["usage"] is None for chunk in reference)  # vLLM sends none unasked

        gate = settled_gate(proxy.url)
        assert (gate["leases"], gate["repricing"]) == (0, 0)  # the first turn's usage is learned
        vllm_server.reset_prefix_cache()  # the session's prefix is gone: its next turn prefills it again
        probes_before_second = prefix_probes(proxy.url)  # the first turn's: repriced beside it, nothing learned yet
        second = first + [
            {"role": "assistant", "content": text_and_ends(got)[0]},
            {"role": "user", "content": "Tool result: " + words(30, "usage-tool")},
        ]
        answer = streamed(via, second, stream_options={"include_usage": True})
        usage = answer[-1]["usage"]  # a client that asks gets its usage event, as from vLLM
        assert answer[-1]["choices"] == [] and usage["prompt_tokens_details"]["cached_tokens"] == 0

        gate = settled_gate(proxy.url)
        assert (gate["leases"], gate["waiters"], gate["waiters_anonymous"]) == (0, [], 0)
        block = vllm_server.block_size
        assert kvgate_metric(proxy.url, "kvgate_reprefill_tokens_estimated_total") == prompt_tokens // block * block
        assert prefix_probes(proxy.url) == probes_before_second  # the second turn was priced by its usage
        via.close()
    finally:
        proxy.stop()
        direct.close()


def first_turn(kind: str) -> dict:
    """A first turn's body, without `model` and the output allowance, per API."""
    system, task = "You are agent. " + words(30, f"{kind}-system"), "Task: " + words(40, f"{kind}-task")
    if kind == "messages":
        return {"system": system, "messages": [{"role": "user", "content": task}]}
    return {"instructions": system, "input": [{"role": "user", "content": task}]}


def next_turn(kind: str, body: dict, reply: str) -> dict:
    """The session's next turn: the last reply and a tool result appended."""
    key = "messages" if kind == "messages" else "input"
    result = {"role": "user", "content": "Tool result: " + words(30, f"{kind}-tool")}
    return {**body, key: [*body[key], {"role": "assistant", "content": reply}, result]}


def send_turn(kind: str, client, body: dict, stream: bool) -> tuple[int, int, str]:
    """One turn through `client`: (prompt tokens, cached prompt tokens, reply text), as its usage says."""
    if kind == "messages":
        request = {"model": MODEL, "max_tokens": 4, **body}
        if stream:
            with client.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**request)
        cached = message.usage.cache_read_input_tokens or 0
        return anthropic_prompt(message.usage), cached, "".join(b.text for b in message.content if b.type == "text")
    request = {"model": MODEL, "max_output_tokens": 4, "temperature": 0.0, **body}
    if stream:
        with client.responses.stream(**request) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**request)
    details = response.usage.input_tokens_details
    return response.usage.input_tokens, details.cached_tokens if details else 0, response.output_text


@pytest.mark.parametrize("kind", ["messages", "responses"])
def test_anthropic_and_responses_turns_teach_the_gate_their_prompt(vllm_server, tmp_path, kind):
    """The same lesson as the chat stream's, from each API's own usage fields: streamed,
    the first turn's prompt is learned; after the cache is emptied, the next turn is
    counted as re-prefilling it whole, without a prefix probe."""
    proxy = usage_proxy(vllm_server, tmp_path)

    def client(url: str, session: str | None = None):
        headers = {"x-session-id": session} if session else None
        if kind == "messages":
            return anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, default_headers=headers)
        return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, default_headers=headers)

    first = first_turn(kind)
    direct = client(vllm_server.url)
    prompt_tokens, _, _ = send_turn(kind, direct, first, stream=False)  # the first turn's prompt, as vLLM counts it
    proxy.start()
    try:
        via = client(proxy.url, f"usage-{kind}")
        vllm_server.reset_prefix_cache()
        got_prompt, _, reply = send_turn(kind, via, first, stream=True)
        assert got_prompt == prompt_tokens

        gate = settled_gate(proxy.url)
        assert (gate["leases"], gate["repricing"]) == (0, 0)  # the first turn's usage is learned
        vllm_server.reset_prefix_cache()  # the session's prefix is gone: its next turn prefills it again
        probes_before_second = prefix_probes(proxy.url)
        _, cached, _ = send_turn(kind, via, next_turn(kind, first, reply), stream=True)
        assert cached == 0

        gate = settled_gate(proxy.url)
        assert (gate["leases"], gate["waiters"], gate["waiters_anonymous"]) == (0, [], 0)
        block = vllm_server.block_size
        assert kvgate_metric(proxy.url, "kvgate_reprefill_tokens_estimated_total") == prompt_tokens // block * block
        assert prefix_probes(proxy.url) == probes_before_second  # the second turn was priced by its usage
        via.close()
    finally:
        proxy.stop()
        direct.close()


def test_a_turn_under_a_cap_far_above_its_reply_is_priced_at_the_reply(vllm_server, tmp_path):
    """An agent's max_tokens is a cap (Claude Code sends 32,000): a turn sent with a cap of
    1,024 whose reply ends in a few tokens (a stop string the random model meets at once)
    leaves its session a window priced at its prompt and the reply vLLM's usage counted,
    not at the cap, and the replica's next turns are priced at that reply, not at their cap."""
    proxy = usage_proxy(vllm_server, tmp_path)
    proxy.start()
    try:
        block = vllm_server.block_size
        via = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        for session in ("capped-1", "capped-2"):
            messages = [{"role": "user", "content": f"{session}: " + words(40, session)}]
            # sampled, as test_final_reply_on_vllm's turns: the random model's text meets a stop within a few tokens
            stream = via.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=1024,
                stop=[" ", "e", "a", "t"],
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-session-id": session},
            )
            usage = [chunk.model_dump() for chunk in stream][-1]["usage"]
            assert usage["completion_tokens"] < 64, usage  # the reply stopped long before its cap
            gate = settled_gate(proxy.url)
            priced = gate["sessions"][session]["footprint_blocks"]
            assert priced == -(-(usage["prompt_tokens"] + usage["completion_tokens"]) // block), (priced, usage)
        via.close()
    finally:
        proxy.stop()
