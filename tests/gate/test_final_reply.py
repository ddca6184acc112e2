"""A reply that ends an agent's run ends its session's window, end to end: the real proxy
and the working_set gate before a simulated replica whose model answers with a tool
call or says its piece, driven by the real `openai` and `anthropic` clients. The window
of a session whose model, free to call a tool, answered without one ends at once (cause
`final_reply`), streamed or not, on each API; a tool call, a request without tools or a
forced tool choice, a reply cut at its cap, and `session.finish_on_final_reply: false`
keep it."""

from __future__ import annotations

import contextlib

import anthropic
import openai
import pytest

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import SessionSettings, Settings
from kvgate.simulator.replica_server import start_simulated_replicas
from kvgate.simulator.reply_model import ReplyModel

MODEL = "kvgate-sim"
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "read", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "read", "parameters": SCHEMA}]
MESSAGES_TOOLS = [{"name": "read", "input_schema": SCHEMA}]
ASK = "read the README and say what the project does"


@contextlib.asynccontextmanager
async def stack(tool_call_rate: float, finish_on_final_reply: bool = True):
    """kvgate (the default working_set gate) before one simulated replica whose replies call a
    tool at `tool_call_rate` (1: always, 0: never); the app and the replica, closed after."""
    (replica,) = await start_simulated_replicas(
        1, time_scale=0.0, reply_model=ReplyModel(median_tokens=12, sigma=0.0, tool_call_rate=tool_call_rate)
    )
    settings = Settings(
        replicas=(ReplicaSettings(replica.name, replica.url),),
        gate=GateSettings(mode="enforce", policy="working_set"),
        session=SessionSettings(finish_on_final_reply=finish_on_final_reply),
    )
    app = create_app(settings, health_checks=False)
    try:
        host, port = await app.start("127.0.0.1", 0)
        yield app, f"http://{host}:{port}"
    finally:
        await app.close()
        await replica.stop()


def window_of(app, session: str) -> tuple[bool | None, int]:
    """Whether the gate books the session with a window (None: no record), and its `final_reply` window ends."""
    (state,) = app.admission.state().values()
    record = state["sessions"].get(session)
    return (None if record is None else record["has_window"]), state["window_ends"]["final_reply"]


def assert_clean(app) -> None:
    for session in list(next(iter(app.admission.state().values()))["sessions"]):
        app.admission.finish_session(session)
    counts = app.admission.counts()
    assert (counts["leases"], counts["waiters"], counts["attempts"], counts["windows"]) == (0, 0, 0, 0)


async def chat_turn(url: str, session: str, stream: bool, **fields) -> str:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
        headers = {"x-session-id": session}
        messages = [{"role": "user", "content": ASK}]
        answer = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, extra_headers=headers, stream=stream, **fields
        )
        if not stream:
            return answer.choices[0].finish_reason
        reasons = [chunk.choices[0].finish_reason async for chunk in answer if chunk.choices]
        return next(reason for reason in reasons if reason is not None)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_chat_reply_without_a_tool_call_ends_the_window_and_a_tool_call_keeps_it(stream):
    async with stack(tool_call_rate=0.0) as (app, url):
        assert await chat_turn(url, "done", stream, tools=CHAT_TOOLS) == "stop"
        assert window_of(app, "done") == (False, 1)  # ended with its turn; the record stays
        # the same reply where the model could not have called a tool says nothing of the run
        assert await chat_turn(url, "chat", stream) == "stop"
        assert await chat_turn(url, "none", stream, tools=CHAT_TOOLS, tool_choice="none") == "stop"
        assert await chat_turn(url, "cut", stream, tools=CHAT_TOOLS, max_completion_tokens=2) == "length"
        for session in ("chat", "none", "cut"):
            assert window_of(app, session) == (True, 1), session
        assert_clean(app)
    async with stack(tool_call_rate=1.0) as (app, url):
        assert await chat_turn(url, "calls", stream, tools=CHAT_TOOLS) == "tool_calls"
        forced = {"type": "function", "function": {"name": "read"}}
        await chat_turn(url, "forced", stream, tools=CHAT_TOOLS, tool_choice=forced)
        assert window_of(app, "calls") == (True, 0) and window_of(app, "forced") == (True, 0)
        assert_clean(app)


async def test_without_finish_on_final_reply_the_window_waits_for_its_quiet_lifetime():
    async with stack(tool_call_rate=0.0, finish_on_final_reply=False) as (app, url):
        assert await chat_turn(url, "done", True, tools=CHAT_TOOLS) == "stop"
        assert await chat_turn(url, "done2", False, tools=CHAT_TOOLS) == "stop"
        assert window_of(app, "done") == (True, 0) and window_of(app, "done2") == (True, 0)
        assert_clean(app)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_anthropic_reply_ends_the_window_on_end_turn_not_on_tool_use(stream):
    for rate, stop, ended in ((0.0, "end_turn", 1), (1.0, "tool_use", 0)):
        async with stack(tool_call_rate=rate) as (app, url):
            async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as client:
                fields = dict(
                    model=MODEL,
                    max_tokens=200,
                    tools=MESSAGES_TOOLS,
                    messages=[{"role": "user", "content": ASK}],
                    extra_headers={"x-session-id": "agent"},
                )
                if stream:
                    async with client.messages.stream(**fields) as events:
                        answer = await events.get_final_message()
                else:
                    answer = await client.messages.create(**fields)
            assert answer.stop_reason == stop
            assert window_of(app, "agent") == ((False, 1) if ended else (True, 0))
            assert_clean(app)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_responses_reply_ends_the_window_without_a_function_call(stream):
    for rate, ended in ((0.0, 1), (1.0, 0)):
        async with stack(tool_call_rate=rate) as (app, url):
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
                fields = dict(
                    model=MODEL,
                    input=ASK,
                    tools=RESPONSES_TOOLS,
                    max_output_tokens=200,
                    store=False,
                    extra_headers={"x-session-id": "agent"},
                )
                if stream:
                    async with client.responses.stream(**fields) as events:
                        answer = await events.get_final_response()
                else:
                    answer = await client.responses.create(**fields)
            assert [item.type for item in answer.output] == (["message"] if ended else ["function_call"])
            assert window_of(app, "agent") == ((False, 1) if ended else (True, 0))
            assert_clean(app)
