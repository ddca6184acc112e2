"""The gate learns each turn's prompt from its usage, and the client sees what it would
have seen without kvgate: the official `openai` and `anthropic` clients, through the real
proxy with the gate on, against a simulated replica (which reports the cached tokens of
each API as vLLM does with --enable-prompt-tokens-details)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.admission import AdmissionController
from kvgate.gate.repricing import Repricer
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.settings import Settings
from kvgate.simulator.replica_server import start_simulated_replicas
from tests.gate.helpers import CLEAN

MESSAGES = [{"role": "user", "content": "list the files of the repository and read the README " * 4}]
NEXT = "now run the tests and say which of them fail " * 4  # a turn that adds full blocks
VOLATILE = {"id", "created"}  # differ between any two answers


def gated_app(name: str, url: str):
    """The proxy with the working_set gate in front of replica `name` at `url` (not
    started), and its AdmissionController."""
    gate_settings = GateSettings(policy="working_set", idle_grace_sec=60.0, quiet_floor_sec=60.0, wait_poll_sec=0.1)
    metrics = KvgateMetrics()
    controller = AdmissionController(gate_settings, metrics.gate)
    app = create_app(
        replace(Settings(), gate=gate_settings, replicas=(ReplicaSettings(name, url),)),
        metrics=metrics,
        admission=controller,
        health_checks=False,
    )
    return app, controller


@pytest.fixture
async def stack():
    """One simulated replica (roomy: every turn's bound fits, so no turn is probed) and the
    proxy with the working_set gate in front; yields (kvgate URL, replica URL, gate)."""
    (replica,) = await start_simulated_replicas(1, time_scale=0.0, num_blocks=512, block_size=16)
    app, controller = gated_app(replica.name, replica.url)
    try:
        host, port = await app.start("127.0.0.1", 0)
        yield f"http://{host}:{port}", replica.url, controller
        for key in list(controller._gates[replica.name]._book.records):
            controller.finish_session(key)
        assert controller._gates[replica.name].counts() == CLEAN
    finally:
        await app.close()
        await replica.stop()


def client(url: str, session: str | None = None) -> openai.AsyncOpenAI:
    headers = {"x-session-id": session} if session else None
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, default_headers=headers)


async def chunks(api: openai.AsyncOpenAI, **options) -> list[dict]:
    stream = await api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=6, stream=True, **options)
    return [chunk.model_dump(exclude=VOLATILE) async for chunk in stream]


def learned(controller: AdmissionController, session: str) -> int | None:
    (gate,) = controller._gates.values()
    return gate._book.records[session].prompt_tokens


async def test_a_stream_without_include_usage_is_relayed_as_sent_and_teaches_the_gate(stack):
    kvgate, replica, controller = stack
    via, direct = client(kvgate, "s"), client(replica)
    got = await chunks(via)
    assert got == await chunks(direct)  # kvgate asked for the usage and took its event out again
    assert got and all(chunk["usage"] is None and chunk["choices"] for chunk in got)
    with_usage = await chunks(direct, stream_options={"include_usage": True})
    # admitted at its bound, unprobed (a roomy replica): the size comes from the turn's usage
    assert learned(controller, "s") == with_usage[-1]["usage"]["prompt_tokens"]
    await via.close()
    await direct.close()


async def test_a_client_that_asks_for_its_usage_gets_it(stack):
    kvgate, replica, controller = stack
    via = client(kvgate, "u")
    got = await chunks(via, stream_options={"include_usage": True})
    usage = got[-1]["usage"]
    assert got[-1]["choices"] == [] and usage["prompt_tokens"] > 0 and usage["completion_tokens"] == 6
    assert learned(controller, "u") == usage["prompt_tokens"]
    answer = await via.chat.completions.create(model="m", messages=MESSAGES + MESSAGES, max_tokens=3)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prefix
    assert learned(controller, "u") == answer.usage.prompt_tokens  # a JSON answer teaches it too
    await via.close()


@pytest.fixture
def taught(monkeypatch) -> list[tuple[int, int | None, int | None]]:
    """Every (prompt_tokens, cached_tokens, output_tokens) a gate is taught by a turn's usage, in order."""
    seen: list[tuple[int, int | None, int | None]] = []
    learn = Repricer.learn

    def spy(repricer, record, turn, prompt_tokens, cached_tokens, output_tokens=None):
        seen.append((prompt_tokens, cached_tokens, output_tokens))
        learn(repricer, record, turn, prompt_tokens, cached_tokens, output_tokens)

    monkeypatch.setattr(Repricer, "learn", spy)
    return seen


async def settled(controller: AdmissionController) -> None:
    """The gate learns a turn's usage before it gives the lease back, which may come just
    after the client read the answer's end."""
    (gate,) = controller._gates.values()
    for _ in range(200):
        if not gate.counts()["leases"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("a lease outlived its turn")


def anthropic_prompt(usage) -> tuple[int, int]:
    """(prompt, cached) of a Messages usage: input_tokens leaves out the cache reads and writes."""
    read = usage.cache_read_input_tokens or 0
    return usage.input_tokens + read + (usage.cache_creation_input_tokens or 0), read


async def anthropic_turn(api: anthropic.AsyncAnthropic, messages: list[dict], stream: bool) -> tuple[str, object]:
    """(reply text, usage) of one Messages turn; a stream's usage is its message_delta's."""
    if not stream:
        message = await api.messages.create(model="m", max_tokens=6, messages=messages)
        return message.content[0].text, message.usage
    text, usage = "", None
    async for event in await api.messages.create(model="m", max_tokens=6, messages=messages, stream=True):
        if event.type == "content_block_delta":
            text += event.delta.text
        elif event.type == "message_delta":
            usage = event.usage
    return text, usage


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages_teach_the_gate_their_prompt_and_cache_reads(stack, taught, stream):
    kvgate, _, controller = stack
    api = anthropic.AsyncAnthropic(
        base_url=kvgate, api_key="k", max_retries=0, default_headers={"x-session-id": "claude"}
    )
    history = list(MESSAGES)
    for turn in (1, 2):
        text, usage = await anthropic_turn(api, history, stream)
        await settled(controller)
        prompt, cached = anthropic_prompt(usage)
        # the first turn's prefix is read from the cache, each turn writes its new full blocks
        assert usage.cache_creation_input_tokens > 0 and (cached > 0) == (turn == 2)
        assert learned(controller, "claude") == prompt and taught[-1] == (prompt, cached, usage.output_tokens)
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": NEXT}]
    assert len(taught) == 2
    await api.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_teach_the_gate_their_prompt_and_cache_reads(stack, taught, stream):
    kvgate, _, controller = stack
    api = client(kvgate, "codex")
    previous = None
    for turn, text in enumerate((MESSAGES[0]["content"], NEXT), 1):
        options = {"previous_response_id": previous} if previous else {}
        if stream:
            events = await api.responses.create(model="m", input=text, max_output_tokens=6, stream=True, **options)
            (response,) = [event.response async for event in events if event.type == "response.completed"]
        else:
            response = await api.responses.create(model="m", input=text, max_output_tokens=6, **options)
        await settled(controller)
        usage = response.usage
        cached = usage.input_tokens_details.cached_tokens
        assert (cached > 0) == (turn == 2)  # the chain's first turn is the prefix of its second
        assert learned(controller, "codex") == usage.input_tokens
        assert taught[-1] == (usage.input_tokens, cached, usage.output_tokens)
        previous = response.id
    assert len(taught) == 2
    await api.close()


@pytest.mark.parametrize("asks", [False, True])
async def test_a_client_gone_after_the_last_event_still_teaches_the_gate(taught, asks):
    """vLLM sent the turn's usage, so it served the turn: kvgate learns it even when the
    client drops the connection before the stream's last bytes (an SDK stops reading at
    `data: [DONE]`; the replica here holds its response open a moment after it), whether
    kvgate asked for the usage (and takes it out) or the client did."""
    done = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream_options"] == {"include_usage": True}  # kvgate asked on the client's behalf
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        delta = {"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}
        usage = {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}
        usage["prompt_tokens_details"] = {"cached_tokens": 16}
        await answer.write(b"data: " + orjson.dumps({"id": "c", "choices": [delta]}) + b"\n\n")
        await answer.write(b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": usage}) + b"\n\n")
        await answer.write(b"data: [DONE]\n\n")
        await done.wait()  # the client is gone before the stream ends
        with contextlib.suppress(ConnectionResetError):  # kvgate dropped this connection with its client's
            await answer.write_eof()
        return answer

    upstream = web.Application()
    upstream.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(upstream, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    app, controller = gated_app("r", f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        host, port = await app.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(host, port)
        request = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "stream": True}
        if asks:
            request["stream_options"] = {"include_usage": True}
        payload = orjson.dumps(request)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\n"
            b"x-session-id: gone\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        received = b""
        while b"data: [DONE]" not in received:
            received += await asyncio.wait_for(reader.read(65536), 10)
        assert (b'"usage"' in received) == asks  # taken out unless the client asked for it
        writer.transport.abort()  # gone at once, as a client that closes its socket at [DONE]
        await asyncio.sleep(0.1)
        done.set()
        await settled(controller)
        assert taught == [(40, 16, 1)]
        controller.finish_session("gone")
        assert controller._gates["r"].counts() == CLEAN
    finally:
        done.set()
        await app.close()
        await runner.cleanup()
