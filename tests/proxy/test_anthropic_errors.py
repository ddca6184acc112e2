"""kvgate's own errors on the Messages API are Anthropic's envelope, parsed by the real
`anthropic` SDK (status, error type, message); the same refusals on the OpenAI routes keep
OpenAI's envelope, parsed by the `openai` SDK.

Each case is a refusal kvgate makes itself, not one it relays: bad input (400), a client
key missing (401), a prompt the replica can never serve (the gate's 400 prompt_too_long),
a replica that cannot be reached (502) and then no healthy replica (503). Every test ends
with no lease, window, waiter or attempt left.
"""

from __future__ import annotations

import socket

import aiohttp
import anthropic
import openai
import pytest

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.errors import ANTHROPIC, OPENAI, error_shape
from kvgate.proxy.settings import AuthSettings, Settings
from kvgate.simulator.replica_server import start_simulated_replicas
from tests.gate.helpers import CLEAN

MODEL = "kvgate-sim"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, shape",
    [
        ("/v1/messages", ANTHROPIC),
        ("/v1/messages/count_tokens", ANTHROPIC),
        ("/sess/a/v1/messages", ANTHROPIC),
        ("/sess/a/v1/messages/count_tokens", ANTHROPIC),
        ("/v1/messagesx", OPENAI),
        ("/v1/chat/completions", OPENAI),
        ("/sess/v1/messages/v1/chat/completions", OPENAI),  # a session id that reads like the path
        ("/admin/state", OPENAI),
        ("", OPENAI),
    ],
)
def test_the_error_shape_follows_the_api_of_the_path(path, shape):
    assert error_shape(path) == shape


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def kvgate():
    """`make(settings, **replica_options)` -> the URL of a kvgate app in front of a simulated replica."""
    apps, replicas = [], []

    async def make(settings: Settings | None = None, **replica_options) -> str:
        started = await start_simulated_replicas(1, time_scale=0, num_blocks=64, block_size=16, **replica_options)
        replicas.extend(started)
        settings = settings or Settings(gate=GateSettings(mode="enforce", policy="working_set"))
        settings = Settings(**{**settings.__dict__, "replicas": tuple(ReplicaSettings(r.name, r.url) for r in started)})
        app = create_app(settings, health_checks=False)
        apps.append(app)
        host, port = await app.start("127.0.0.1", 0)
        return f"http://{host}:{port}"

    try:
        yield make
    finally:
        for app in apps:
            assert app.admission.counts() == CLEAN
            await app.close()
        for replica in replicas:
            await replica.stop()


def anthropic_code(error: anthropic.APIStatusError) -> str:
    """The kvgate code of an error in Anthropic's envelope (asserting that envelope)."""
    body = error.body
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message", "code"} and body["error"]["message"] == error.api_message, body
    return body["error"]["code"]


@pytest.fixture
async def clients():
    """`make(url)` -> an Anthropic and an OpenAI client of kvgate at `url`, closed at the end."""
    made: list = []

    def make(url: str) -> tuple[anthropic.AsyncAnthropic, openai.AsyncOpenAI]:
        pair = (
            anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0),
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0),
        )
        made.extend(pair)
        return pair

    try:
        yield make
    finally:
        for client in made:
            await client.close()


async def test_bad_input_is_an_anthropic_invalid_request_error(kvgate, clients):
    claude, gpt = clients(await kvgate())
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES, extra_body={"stream": "yes"})
    error = refused.value
    assert (error.status_code, error.type) == (400, "invalid_request_error")
    assert error.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": error.api_message, "code": "invalid_type"},
    }
    assert "'stream' must be a boolean" in error.api_message
    with pytest.raises(openai.BadRequestError) as refused_openai:
        await gpt.chat.completions.create(model=MODEL, max_tokens=4, messages=MESSAGES, extra_body={"stream": "yes"})
    assert refused_openai.value.status_code == 400
    assert refused_openai.value.body == {
        "message": refused_openai.value.body["message"],  # type: ignore[index]
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_type",
    }


async def test_a_missing_client_key_is_an_anthropic_authentication_error(kvgate, clients):
    settings = Settings(auth=AuthSettings(api_keys=("right-key",)), gate=GateSettings(mode="enforce"))
    claude, gpt = clients(await kvgate(settings))  # they send api key "k"
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await claude.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
    assert (refused.value.status_code, refused.value.type) == (401, "authentication_error")
    assert anthropic_code(refused.value) == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as refused_openai:
        await gpt.chat.completions.create(model=MODEL, max_tokens=4, messages=MESSAGES)
    assert refused_openai.value.code == "invalid_api_key"
    assert refused_openai.value.type == "authentication_error"


async def test_the_gates_refusal_is_an_anthropic_error(kvgate, clients):
    """A prompt longer than the replica serves: the prefix probe says so and the gate refuses
    the turn (400 prompt_too_long) without forwarding it."""
    url = await kvgate(max_model_len=256)
    claude, gpt = clients(url)
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=long,
            extra_headers={"x-session-id": "long-anthropic", "x-session-finish": "true"},
        )
    assert (refused.value.status_code, refused.value.type) == (400, "invalid_request_error")
    assert anthropic_code(refused.value) == "prompt_too_long"
    assert refused.value.response.headers.get("x-kvgate-replica") == "sim0"
    with pytest.raises(openai.BadRequestError) as refused_openai:
        await gpt.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=long,
            extra_headers={"x-session-id": "long-openai", "x-session-finish": "true"},
        )
    assert (refused_openai.value.code, refused_openai.value.type) == ("prompt_too_long", "invalid_request_error")


async def test_unreachable_and_then_no_healthy_replica_are_anthropic_errors(clients):
    port = closed_port()
    settings = Settings(replicas=(ReplicaSettings("gone", f"http://127.0.0.1:{port}"),), gate=GateSettings(mode="off"))
    app = create_app(settings, health_checks=False)
    host, bound = await app.start("127.0.0.1", 0)
    try:
        claude, gpt = clients(f"http://{host}:{bound}")
        with pytest.raises(anthropic.APIStatusError) as broken:
            await claude.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
        assert (broken.value.status_code, broken.value.type) == (502, "api_error")
        assert anthropic_code(broken.value) == "upstream_connect_failed"
        with pytest.raises(anthropic.InternalServerError) as none_left:
            await claude.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
        assert (none_left.value.status_code, none_left.value.type) == (503, "overloaded_error")
        assert anthropic_code(none_left.value) == "no_healthy_replica"
        assert none_left.value.response.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError) as none_left_openai:
            await gpt.chat.completions.create(model=MODEL, max_tokens=4, messages=MESSAGES)
        assert (none_left_openai.value.status_code, none_left_openai.value.code) == (503, "no_healthy_replica")
        assert none_left_openai.value.type == "service_unavailable"
    finally:
        await app.close()
    assert app.admission.counts() == CLEAN


async def test_a_body_too_large_for_the_messages_api_is_refused_in_its_shape(kvgate):
    """Refused by the HTTP server from the declared length, before any handler runs."""
    url = await kvgate(Settings(limits=_limits(max_body_bytes=1024)))
    async with aiohttp.ClientSession() as http:
        for path, expected in (("/v1/messages", "request_too_large"), ("/v1/chat/completions", None)):
            async with http.post(url + path, data=b"x" * 4096, headers={"Content-Type": "application/json"}) as resp:
                body = await resp.json()
            assert resp.status == 413
            if expected:
                assert body["type"] == "error" and body["error"]["type"] == expected, body
                assert body["error"]["code"] == "body_too_large"
            else:
                assert body["error"]["code"] == "body_too_large" and "type" not in body, body


def _limits(**values):
    from kvgate.proxy.settings import LimitsSettings

    return LimitsSettings(**values)
