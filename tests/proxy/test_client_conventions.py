"""Agent clients' own session conventions, with their real SDKs, through kvgate (the
working_set gate enforcing) in front of two simulated replicas: a request that carries
only Claude Code's, Codex CLI's or OpenCode's header is that session (the gate books it
under that id) and stays on one replica; the routes clients call besides generation
(count_tokens, Responses retrieve) reach the session's replica without the gate; and two
distinct requests of one session at once are both served under pressure, while a
re-sent turn still supersedes. Every test ends with no lease, waiter or attempt left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import aiohttp
import anthropic
import openai
import pytest

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.session_id import resolve_session_id
from kvgate.proxy.settings import CLIENT_SESSION_HEADERS, SessionSettings, Settings
from kvgate.simulator.replica_server import start_simulated_replicas

MODEL = "kvgate-sim"
FINISH = {"x-session-finish": "true"}
SESSIONS = [f"5f0c9d3e-0000-4000-8000-00000000000{i}" for i in range(6)]


class Stack:
    def __init__(self, app, url: str) -> None:
        self.app = app
        self.url = url

    def anthropic(self, **kwargs) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key="k", max_retries=0, **kwargs)

    def openai(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0, **kwargs)

    def booked(self) -> set[str]:
        """Session ids the gates book (sessions acquiring, in flight or holding a window)."""
        return {key for gate in self.app.admission.state().values() for key in gate["sessions"]}

    def assert_clean(self) -> None:
        counts = self.app.admission.counts()
        assert (counts["leases"], counts["waiters"], counts["attempts"]) == (0, 0, 0), counts


@contextlib.asynccontextmanager
async def running_stack(num_blocks: int = 256, place_sessions: bool = True, **settings):
    """kvgate (working_set, enforcing) before two simulated replicas of `num_blocks` blocks;
    everything stopped on exit. `place_sessions`: `gate.place_sessions`."""
    replicas = await start_simulated_replicas(2, time_scale=0, num_blocks=num_blocks, block_size=16)
    config = Settings(
        replicas=tuple(ReplicaSettings(r.name, r.url) for r in replicas),
        gate=GateSettings(mode="enforce", policy="working_set", place_sessions=place_sessions),
        **settings,
    )
    app = create_app(config, health_checks=False)
    try:
        host, port = await app.start("127.0.0.1", 0)
        yield Stack(app, f"http://{host}:{port}")
    finally:
        await app.close()
        for replica in replicas:
            await replica.stop()


@pytest.fixture
async def stack():
    async with running_stack() as made:
        yield made


def assert_sticky(replicas_by_session: dict[str, list[str]]) -> None:
    """Every session stayed on one replica, and the sessions did not all land on one (the
    header, hashed, chose the replica: an anonymous request goes to the least loaded)."""
    assert all(len(set(names)) == 1 for names in replicas_by_session.values()), replicas_by_session
    assert len({names[0] for names in replicas_by_session.values()}) == 2, replicas_by_session


# ---- one test per client convention ----------------------------------------------------


async def claude_code_turn(client, history: list[dict], headers) -> tuple[str, str]:
    raw = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=history, extra_headers=headers
    )
    return raw.headers["x-kvgate-replica"], (await raw.parse()).content[0].text


async def codex_turn(client, history: list[dict], headers) -> tuple[str, str]:
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input=history, store=False, max_output_tokens=4, extra_headers=headers
    )
    return raw.headers["x-kvgate-replica"], raw.parse().output_text


async def opencode_turn(client, history: list[dict], headers) -> tuple[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=history, max_tokens=4, extra_headers=headers
    )
    return raw.headers["x-kvgate-replica"], raw.parse().choices[0].message.content or ""


@pytest.mark.parametrize(
    "header, sdk, send",
    [
        ("x-claude-code-session-id", "anthropic", claude_code_turn),  # Claude Code: /v1/messages
        ("session_id", "openai", codex_turn),  # Codex CLI: /v1/responses, store false
        ("x-session-affinity", "openai", opencode_turn),  # OpenCode: chat completions
    ],
)
async def test_a_client_session_header_alone_is_the_session(stack, header, sdk, send):
    """Three turns of six sessions, each carrying its id only in the client's own header:
    the gate books each under that id, and each stays on one replica."""
    seen: dict[str, list[str]] = {}
    for sid in SESSIONS:
        client = getattr(stack, sdk)(default_headers={header: sid})
        history: list[dict] = []
        for turn in range(3):
            history.append({"role": "user", "content": f"step {turn} of the task"})
            replica, text = await send(client, history, FINISH if turn == 2 else None)
            history.append({"role": "assistant", "content": text or "ok"})
            seen.setdefault(sid, []).append(replica)
            if turn == 0:
                assert sid in stack.booked()  # booked under the client's own id (no body field sent)
        await client.close()
    assert_sticky(seen)
    stack.assert_clean()


@pytest.mark.parametrize(
    "order, expected",
    [
        (CLIENT_SESSION_HEADERS, "claude"),  # the default: Claude Code's, Codex's, OpenCode's
        (("x-session-affinity", "x-claude-code-session-id"), "affinity"),
        ((), None),  # none read: only kvgate's own header and the body
    ],
)
def test_the_client_headers_are_read_in_the_configured_order(order, expected):
    headers = {"x-claude-code-session-id": "claude", "session_id": "codex", "x-session-affinity": "affinity"}
    assert resolve_session_id(None, headers, ("x-session-id", *order), {}, ()) == expected
    assert resolve_session_id(None, {**headers, "x-session-id": "own"}, ("x-session-id", *order), {}, ()) == "own"


async def test_client_headers_are_a_setting(tmp_path):
    from kvgate.proxy.config import load_settings

    path = tmp_path / "kvgate.yaml"
    path.write_text("session: {client_headers: [x-session-affinity]}\n")
    assert load_settings(path, {}).session.client_headers == ("x-session-affinity",)
    assert load_settings(None, {"KVGATE_SESSION__CLIENT_HEADERS": "[]"}).session.client_headers == ()


# ---- the routes clients call besides generation -----------------------------------------


async def test_count_tokens_reaches_the_session_replica_without_the_gate(stack):
    sid = SESSIONS[0]
    client = stack.anthropic(default_headers={"x-claude-code-session-id": sid})
    messages = [{"role": "user", "content": "how many tokens is this?"}]
    turn = await client.messages.with_raw_response.create(model=MODEL, max_tokens=4, messages=messages)
    replica = turn.headers["x-kvgate-replica"]
    counts_before = stack.app.admission.counts()
    raw = await client.messages.with_raw_response.count_tokens(model=MODEL, messages=messages)
    assert (await raw.parse()).input_tokens > 0  # the replica rendered and counted the prompt
    assert raw.headers["x-kvgate-replica"] == replica and "x-kvgate-admission" not in raw.headers
    state = stack.app.admission.state()
    assert sum(g["sessions"].get(sid, {}).get("in_flight", 0) for g in state.values()) == 0
    assert stack.app.admission.counts()["attempts"] == counts_before["attempts"] == 0
    await client.messages.create(model=MODEL, max_tokens=4, messages=messages, extra_headers=FINISH)
    await client.close()
    stack.assert_clean()


async def test_responses_retrieve_reaches_the_replica_that_holds_the_response(stack):
    client = stack.openai()
    first = await client.responses.with_raw_response.create(model=MODEL, input="start", max_output_tokens=4)
    created = first.parse()
    replica = first.headers["x-kvgate-replica"]
    # from another session's point of view too: the response decides the replica
    for headers in ({}, {"x-session-id": "someone-else"}):
        raw = await client.responses.with_raw_response.retrieve(created.id, extra_headers=headers)
        assert raw.headers["x-kvgate-replica"] == replica
        assert raw.parse().id == created.id and raw.parse().output_text == created.output_text
    with pytest.raises(openai.NotFoundError):  # the replica answers for a response it does not hold
        await client.responses.retrieve("resp_never_made")
    await client.close()
    stack.assert_clean()


async def test_other_vllm_routes_are_relayed_and_the_probe_api_is_not(stack):
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.url + "/tokenize", json={"prompt": "hi"}) as resp:
            assert resp.status == 404 and resp.headers["x-kvgate-replica"]  # the replica's own answer
        async with http.get(stack.url + "/v1/kvgate/kv") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_route"
    stack.assert_clean()


# ---- concurrent requests of one session -------------------------------------------------


async def test_distinct_concurrent_requests_of_a_session_are_both_served_under_pressure():
    """The reproduction: a 40-block replica pair under load; one session sends its main
    turn and a side request (a title) at once. Both are served (on main, the older got 409
    admission_superseded)."""
    async with running_stack(num_blocks=40) as made:
        client = made.openai()
        context = "tool output line\n" * 60
        load = [
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"load {i}: {context}"}],
                max_tokens=8,
                extra_headers={"x-session-id": f"load-{i}", **FINISH},
            )
            for i in range(6)
        ]
        main = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "main task: " + context}],
            max_tokens=8,
            extra_headers={"x-claude-code-session-id": "agent"},
        )
        side = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a title for this conversation"}],
            max_tokens=4,
            extra_headers={"x-claude-code-session-id": "agent"},
        )
        answers = await asyncio.gather(*load, main, side, return_exceptions=True)
        failures = [a for a in answers if isinstance(a, BaseException)]
        assert not failures, failures
        made.app.admission.finish_session("agent")
        assert (
            sum(g["sessions"].get("agent", {}).get("num_superseded", 0) for g in made.app.admission.state().values())
            == 0
        )
        made.assert_clean()
        await client.close()


async def test_a_resent_turn_still_supersedes_through_kvgate():
    """Hold the session's turn at the gate (its replica is full of another session's
    window), re-send the same turn: the first attempt gets 409 admission_superseded, the
    re-sent one is served once the window frees."""
    async with running_stack(num_blocks=40, place_sessions=False, session=SessionSettings()) as made:
        client = made.openai()
        big = "x " * 500
        # one session fills one replica's 40 blocks with its window; the agent's session is
        # pinned there by its id (the same rendezvous choice as the filler's below; the gate
        # would place it on the empty replica)
        filler_id, agent_id = _same_replica_ids(made)
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": big}],
            max_tokens=4,
            extra_headers={"x-session-id": filler_id},
        )
        turn = dict(model=MODEL, messages=[{"role": "user", "content": "agent " + big}], max_tokens=4)
        first = asyncio.create_task(client.chat.completions.create(**turn, extra_headers={"session_id": agent_id}))
        await _until(lambda: _waiting(made) == 1)
        resent = asyncio.create_task(client.chat.completions.create(**turn, extra_headers={"session_id": agent_id}))
        with pytest.raises(openai.ConflictError) as refused:
            await first
        assert refused.value.body["code"] == "admission_superseded"  # type: ignore[index]
        made.app.admission.finish_session(filler_id)
        await asyncio.wait_for(resent, 30)
        made.app.admission.finish_session(agent_id)
        made.assert_clean()
        await client.close()


def _same_replica_ids(stack: Stack) -> tuple[str, str]:
    balancer = stack.app.balancer
    ids = [f"s-{i}" for i in range(64)]
    first = balancer.choose(ids[0])
    other = next(i for i in ids[1:] if balancer.choose(i) is first)
    return ids[0], other


def _waiting(stack: Stack) -> int:
    return stack.app.admission.counts()["waiters"]


async def _until(condition, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_settings_default_lists_the_three_clients():
    assert SessionSettings().client_headers == ("x-claude-code-session-id", "session_id", "x-session-affinity")
    assert dataclasses.replace(SessionSettings(), client_headers=()).client_headers == ()


async def test_a_passthrough_body_field_of_another_type_is_not_refused(stack):
    """`user` is a session field on the turn routes (a non-string is a 400 there); on a route
    kvgate only relays, the replica judges the body."""
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "user": 7}
        async with http.post(stack.url + "/v1/messages/count_tokens", json=body) as resp:
            assert resp.status == 200 and (await resp.json())["input_tokens"] > 0
        async with http.post(stack.url + "/v1/chat/completions", json={**body, "max_tokens": 2}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_type"
    stack.assert_clean()
