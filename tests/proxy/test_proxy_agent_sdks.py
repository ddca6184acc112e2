"""Agent clients with the official SDKs: `anthropic` and `openai` (Responses) clients through
kvgate, with the working_set gate enforcing, in front of two simulated replicas.

Each turn's probe reading is checked against the generation itself: asked right before
the turn (same body, same replica), the probe's `total_tokens` is the prompt the replica
reports in usage, and its `hit_tokens` the tokens the replica then reused. Every test
finishes its sessions and ends with no lease, window, waiter or attempt left.
"""

from __future__ import annotations

import json
import re

import aiohttp
import anthropic
import openai
import pytest
from serve_process import start_serve, stop_serve

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import Settings
from kvgate.simulator.replica_server import start_simulated_replicas
from tests.gate.helpers import CLEAN

MODEL = "kvgate-sim"
FINISH = {"x-session-finish": "true"}
TOOLS = [
    {
        "name": "read_file",
        "description": "read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]


class Stack:
    def __init__(self, app, url: str, replicas) -> None:
        self.app = app
        self.url = url
        self.replicas = {r.name: r for r in replicas}
        self.http = aiohttp.ClientSession()

    def anthropic(self, **kwargs) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key="k", max_retries=0, **kwargs)

    def openai(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0, **kwargs)

    async def probe(self, replica: str, kind: str, body: dict) -> dict:
        async with self.http.post(self.replicas[replica].url + "/v1/kvgate/prefix", json={kind: body}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def prefix_probes(self) -> int:
        """How many prefix probes the gates sent (kvgate_probe_seconds_count, all replicas)."""
        async with self.http.get(self.url + "/metrics") as resp:
            text = await resp.text()
        return sum(int(float(n)) for n in re.findall(r'kvgate_probe_seconds_count\{probe="prefix",[^}]*\} (\S+)', text))

    def assert_clean(self) -> None:
        assert self.app.admission.counts() == CLEAN


@pytest.fixture
async def stack():
    replicas = await start_simulated_replicas(2, time_scale=0, num_blocks=256, block_size=16)
    settings = Settings(
        replicas=tuple(ReplicaSettings(r.name, r.url) for r in replicas),
        gate=GateSettings(mode="enforce", policy="working_set"),
    )
    app = create_app(settings, health_checks=False)
    host, port = await app.start("127.0.0.1", 0)
    made = Stack(app, f"http://{host}:{port}", replicas)
    try:
        yield made
    finally:
        await made.http.close()
        await app.close()
        for replica in replicas:
            await replica.stop()


def prompt_of(usage) -> int:
    """A Messages answer's whole prompt: its input_tokens leave out the cache reads and writes."""
    return usage.input_tokens + (usage.cache_creation_input_tokens or 0) + (usage.cache_read_input_tokens or 0)


def claude_code_metadata(session: str) -> dict:
    """What Claude Code >= 2.1.78 sends: a JSON string in metadata.user_id."""
    return {"user_id": json.dumps({"device_id": "dev-1", "account_uuid": "acc-1", "session_id": session})}


# ---------------------------------------------------------------- anthropic


async def test_anthropic_messages_create_is_sticky_by_claude_code_metadata_and_probed_exactly(stack):
    client = stack.anthropic()
    history = [{"role": "user", "content": "Task: fix the failing test in parser dot py"}]
    replicas = set()
    cached = []
    for turn in range(1, 5):
        body = {
            "model": MODEL,
            "max_tokens": 6,
            "system": "You are a coding agent.",
            "messages": history,
            "metadata": claude_code_metadata("cc-session-1"),
        }
        last = turn == 4
        probe_before = None
        if replicas:
            probe_before = await stack.probe(next(iter(replicas)), "messages", body)
        raw = await client.messages.with_raw_response.create(**body, extra_headers=FINISH if last else None)
        message = await raw.parse()  # anthropic's async raw response parses asynchronously
        replica = raw.headers["x-kvgate-replica"]
        replicas.add(replica)
        assert message.type == "message" and message.content[0].type == "text"
        if probe_before is not None:
            assert probe_before["total_tokens"] == prompt_of(message.usage)
            assert probe_before["hit_tokens"] == message.usage.cache_read_input_tokens
        cached.append(message.usage.cache_read_input_tokens)
        history = history + [
            {"role": "assistant", "content": message.content[0].text},
            {"role": "user", "content": f"Tool result {turn}: ran the tests, two still fail"},
        ]
    assert len(replicas) == 1  # one session, one replica: the id came from metadata.user_id
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    await client.close()
    stack.assert_clean()


async def test_anthropic_messages_stream(stack):
    client = stack.anthropic()
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "stream this please"}],
        "metadata": claude_code_metadata("cc-stream"),
    }
    async with client.messages.stream(**body, extra_headers=FINISH) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert texts and "".join(texts) == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
    await client.close()
    stack.assert_clean()


async def test_anthropic_tool_use_conversation_is_probed_exactly(stack):
    client = stack.anthropic()
    messages = [
        {"role": "user", "content": "Read the config file"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "kvgate.yaml"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "listen: {port: 8000}"}],
        },
    ]
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "tools": TOOLS,
        "messages": messages,
        "metadata": claude_code_metadata("cc-tools"),
    }
    first = await client.messages.with_raw_response.create(**body)
    replica = first.headers["x-kvgate-replica"]
    reading = await stack.probe(replica, "messages", body)
    again = await client.messages.with_raw_response.create(**body, extra_headers=FINISH)
    assert again.headers["x-kvgate-replica"] == replica
    usage = (await again.parse()).usage
    assert reading["total_tokens"] == prompt_of(usage) == prompt_of((await first.parse()).usage)
    assert reading["hit_tokens"] == usage.cache_read_input_tokens > 0
    # the tool definitions are part of the rendered prompt
    without_tools = await stack.probe(replica, "messages", {**body, "tools": None})
    assert without_tools["total_tokens"] < reading["total_tokens"]
    await client.close()
    stack.assert_clean()


# ---------------------------------------------------------------- openai responses


async def test_responses_create_and_stream(stack):
    client = stack.openai(default_headers={"x-session-id": "resp-basic"})
    response = await client.responses.create(model=MODEL, input="hello", instructions="be brief", max_output_tokens=4)
    assert response.object == "response" and response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens == 4
    stream = await client.responses.create(
        model=MODEL, input="hello again", max_output_tokens=4, stream=True, extra_headers=FINISH
    )
    types, deltas, completed = [], [], None
    async for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            completed = event.response
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert completed is not None and completed.output_text == "".join(deltas)
    await client.close()
    stack.assert_clean()


async def test_previous_response_id_chains_stay_on_their_replica_and_are_priced_by_the_probe(stack):
    """Eight anonymous chains over two replicas: turn 1 is routed like any anonymous
    request; every continuation goes to the replica holding its state (the other one
    would answer 404), is the chain's session, and is priced by the probe with that state."""
    client = stack.openai()
    chains = {}
    for index in range(8):
        raw = await client.responses.with_raw_response.create(
            model=MODEL,
            instructions="You are agent.",
            input=f"Task {index}: refactor module {index}",
            max_output_tokens=4,
        )
        chains[index] = (raw.parse().id, raw.headers["x-kvgate-replica"])
    assert set(replica for _, replica in chains.values()) == {"sim0", "sim1"}
    probes_before = await stack.prefix_probes()
    continuations = 0
    for turn in range(2, 5):
        for index, (previous_id, replica) in list(chains.items()):
            body = {
                "model": MODEL,
                "instructions": "You are agent.",
                "previous_response_id": previous_id,
                "input": [{"role": "user", "content": f"Tool result {turn}: {index} tests pass"}],
                "max_output_tokens": 4,
            }
            reading = await stack.probe(replica, "responses", body)
            raw = await client.responses.with_raw_response.create(**body, extra_headers=FINISH if turn == 4 else None)
            response = raw.parse()
            continuations += 1
            assert raw.headers["x-kvgate-replica"] == replica
            assert raw.headers["x-kvgate-admission"] in ("window_fits", "holds_window")
            assert reading["total_tokens"] == response.usage.input_tokens
            assert reading["hit_tokens"] == response.usage.input_tokens_details.cached_tokens > 0
            chains[index] = (response.id, replica)
    # a continuation's body does not hold its prompt: the gate probed every one of them
    assert await stack.prefix_probes() - probes_before >= continuations
    assert len(stack.app.sessions.responses) == 0  # finishing a chain's session dropped all its links
    await client.close()
    stack.assert_clean()


async def test_streamed_chain_turns_and_an_explicit_session(stack):
    client = stack.openai()
    task = "start with the parser module and then move on to the lexer and the tests of both"
    first = await client.responses.create(
        model=MODEL, input=task, max_output_tokens=3, extra_body={"prompt_cache_key": "codex-conv-7"}
    )
    stream = await client.responses.create(
        model=MODEL,
        input="go on",
        previous_response_id=first.id,
        max_output_tokens=3,
        stream=True,
        extra_headers=FINISH,
    )
    completed = [event.response async for event in stream if event.type == "response.completed"]
    assert completed and completed[0].usage.input_tokens > first.usage.input_tokens
    assert completed[0].usage.input_tokens_details.cached_tokens > 0
    await client.close()
    stack.assert_clean()  # the finish header on the continuation ended the codex-conv-7 window


async def test_unknown_previous_response_id_is_the_replicas_404(stack):
    client = stack.openai()
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL, input="x", previous_response_id="resp_never_made")
    assert len(stack.app.sessions.responses) == 0
    await client.close()
    stack.assert_clean()


async def test_the_embedded_default_speaks_every_forwarded_route(tmp_path):
    """`kvgate serve` with no replicas: chat, completions, messages and responses all answer."""
    config = tmp_path / "empty.yaml"
    config.write_text("simulated_replicas: 2\n")
    proc, _lines, url = await start_serve("--config", str(config))
    try:
        oa = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="k", max_retries=0, default_headers={"x-session-id": "newcomer"}
        )
        an = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
        model = (await oa.models.list()).data[0].id
        chat = await oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        completion = await oa.completions.create(model=model, prompt="hi", max_tokens=3)
        message = await an.messages.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        first = await oa.responses.create(model=model, input="hi", max_output_tokens=3)
        second = await oa.responses.create(
            model=model, input="and?", previous_response_id=first.id, max_output_tokens=3
        )
        assert chat.choices[0].message.content and completion.choices[0].text
        assert message.content[0].text and first.output_text and second.output_text
        assert second.usage.input_tokens > first.usage.input_tokens
        await oa.close()
        await an.close()
    finally:
        assert await stop_serve(proc) == 0
