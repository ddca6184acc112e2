"""The official `openai` client through kvgate, against two replicas."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "hello"}]


def base(client) -> str:
    return f"http://{client.server.host}:{client.server.port}"


def header_client(proxy, session_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=base(proxy) + "/v1", api_key="k", max_retries=0, default_headers={"x-session-id": session_id}
    )


def path_client(proxy, session_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base(proxy)}/sess/{session_id}/v1", api_key="k", max_retries=0)


async def chat_replica(client: openai.AsyncOpenAI) -> str:
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    completion = raw.parse()
    replica = raw.headers["x-kvgate-replica"]
    assert completion.choices[0].message.content == f"hello from {replica}"
    return replica


@pytest.mark.parametrize("make_client", [header_client, path_client], ids=["header", "path"])
async def test_chat_and_completions_streaming_and_not(proxy, make_client):
    client = make_client(proxy, "sess-A")
    replica = await chat_replica(client)

    completion = await client.completions.create(model="m", prompt="hi")
    assert completion.choices[0].text == f"hello from {replica}"

    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == f"{replica} t1 t2 t3 t4"

    stream = await client.completions.create(model="m", prompt="hi", stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    assert text == f"{replica} t1 t2 t3 t4"
    await client.close()


async def test_same_session_same_replica_for_header_and_path_clients(proxy):
    for i in range(12):
        sid = f"agent-{i}"
        by_header, by_path = header_client(proxy, sid), path_client(proxy, sid)
        first = await chat_replica(by_header)
        for _ in range(3):
            assert await chat_replica(by_header) == first
            assert await chat_replica(by_path) == first
        await by_header.close()
        await by_path.close()


async def test_killing_a_replica_moves_only_its_sessions(proxy, upstreams):
    sessions = [f"agent-{i}" for i in range(16)]
    clients = {sid: header_client(proxy, sid) for sid in sessions}
    before = {sid: await chat_replica(c) for sid, c in clients.items()}
    assert set(before.values()) == {"r0", "r1"}

    r0 = next(f for f in upstreams if f.name == "r0")
    await r0.refuse()
    after = {sid: await chat_replica(c) for sid, c in clients.items()}  # max_retries=0: no client retry

    assert all(after[s] == "r1" for s in sessions)
    moved = {s for s in sessions if before[s] != after[s]}
    assert moved == {s for s in sessions if before[s] == "r0"}
    for c in clients.values():
        await c.close()
