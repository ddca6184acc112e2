"""The simulated replica's HTTP surface: vLLM routes, metrics, probe API, aborts, seam 2."""

import asyncio
import re

import aiohttp
import orjson
import pytest

from kvgate.simulator.replica_server import ENGINE_KEY, SimulatedReplica, start_simulated_replicas
from kvgate.simulator.tokenizer import MAX_TOKEN_BYTES

CHAT = {
    "model": "any",
    "messages": [{"role": "user", "content": "list the files in the repository " * 8}],
    "max_tokens": 5,
}


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def test_chat_completion_non_streaming(replica_client):
    client = await replica_client()
    response = await client.post("/v1/chat/completions", json=CHAT | {"session_id": "s1", "ignore_eos": True})
    assert response.status == 200
    body = await response.json()
    assert body["object"] == "chat.completion" and body["model"] == "any"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    again = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]  # deterministic
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_chat_streaming_sse_with_usage(replica_client):
    client = await replica_client()
    body = CHAT | {"stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    raw = (await response.read()).decode()
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 5
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


async def test_completions_streaming_and_token_id_prompt(replica_client):
    client = await replica_client()
    response = await client.post("/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 3, "stream": True})
    raw = (await response.read()).decode()
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]" and len(events) == 4
    assert all(orjson.loads(e)["object"] == "text_completion" for e in events[:-1])
    plain = await (await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})).json()
    assert plain["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 4,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/v1/chat/completions", b"not json", "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", orjson.dumps({"model": "m"}), "messages"),
        ("/v1/chat/completions", orjson.dumps(CHAT | {"max_tokens": 0}), "max_tokens"),
        ("/v1/chat/completions", orjson.dumps(CHAT | {"max_tokens": "5"}), "max_tokens"),
        ("/v1/chat/completions", orjson.dumps(CHAT | {"stream": "yes"}), "stream"),
        ("/v1/chat/completions", orjson.dumps(CHAT | {"n": 2}), "n=1"),
        ("/v1/chat/completions", orjson.dumps(CHAT | {"max_tokens": 5, "min_tokens": 6}), "min_tokens"),
        ("/v1/chat/completions", orjson.dumps(CHAT | {"min_tokens": -1}), "min_tokens"),
        ("/v1/chat/completions", orjson.dumps(CHAT | {"max_tokens": 5000}), "maximum context length is 1024"),
        ("/v1/completions", orjson.dumps({"prompt": "word " * 2000}), "longer than the maximum model length"),
        ("/v1/completions", orjson.dumps({"max_tokens": 3}), "prompt"),
    ],
)
async def test_bad_bodies_get_vllm_shaped_400(replica_client, path, body, needle):
    client = await replica_client(num_blocks=64, block_size=16)
    response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and needle in error["message"]


async def test_models_health_and_metrics(replica_client):
    client = await replica_client(num_blocks=64, block_size=16)
    assert (await client.get("/health")).status == 200
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "kvgate-sim" and models["data"][0]["max_model_len"] == 1024
    await client.post("/v1/chat/completions", json=CHAT)
    await client.post("/v1/chat/completions", json=CHAT)
    text = await (await client.get("/metrics")).text()
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "kvgate_sim:recomputed_tokens_total",
        "kvgate_sim:preemptions_total",
        "kvgate_sim:evictions_total",
    ):
        metric(text, name)
    assert (
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="65"} 1.0'
        in text
    )
    assert metric(text, "vllm:prefix_cache_hits_total") > 0
    assert metric(text, "vllm:prefix_cache_queries_total") > metric(text, "vllm:prefix_cache_hits_total")


async def test_kv_probe_shape(replica_client):
    client = await replica_client(num_blocks=64, block_size=16)
    await client.post("/v1/chat/completions", json=CHAT)
    kv = await (await client.get("/v1/kvgate/kv")).json()
    assert kv["version"] == 1 and kv["num_total_blocks"] == 64 and kv["block_size"] == 16
    assert kv["kv_cache_usage"] == 0.0 and kv["num_free_blocks"] == 64 and kv["num_cached_blocks"] > 0
    # the server's own figures: its longest prompt (the whole cache by default) and longest token
    assert (kv["max_model_len"], kv["max_token_bytes"]) == (64 * 16, MAX_TOKEN_BYTES)
    assert kv["scheduling_policy"] == "fcfs"  # vLLM's default --scheduling-policy
    server_only = {"max_model_len": None, "max_token_bytes": None, "scheduling_policy": None}
    assert kv["engines"] == [{"engine": 0, **{k: v for k, v in kv.items() if k != "engines"}, **server_only}]


async def test_prefix_probe_renders_like_generation_and_has_no_side_effects(replica_client):
    client = await replica_client(num_blocks=64, block_size=16)
    engine = client.server.app[ENGINE_KEY]
    body = CHAT | {"cache_salt": "tenant-a"}
    before = await (await client.post("/v1/kvgate/prefix", json={"chat": body})).json()
    assert before["hit_blocks"] == 0 and before["total_blocks"] > 0 and before["hit_ratio"] == 0.0
    usage = (await (await client.post("/v1/chat/completions", json=body)).json())["usage"]
    assert before["total_tokens"] == usage["prompt_tokens"]
    metrics_before = await (await client.get("/metrics")).text()
    queue_before = engine.scheduler.kv_cache_manager.block_pool.free_block_queue.block_ids()
    after = await (await client.post("/v1/kvgate/prefix", json={"chat": body})).json()
    assert after["hit_blocks"] == after["total_blocks"] and after["hit_ratio"] == 1.0
    assert after["hit_tokens"] == after["hit_blocks"] * 16 and after["hit_blocks_evictable"] == after["hit_blocks"]
    unsalted = await (await client.post("/v1/kvgate/prefix", json={"chat": CHAT})).json()
    assert unsalted["hit_blocks"] == 0
    ids = await (await client.post("/v1/kvgate/prefix", json={"completion": {"prompt": [1, 2, 3] * 20}})).json()
    assert ids["total_tokens"] == 60 and ids["total_blocks"] == 3
    assert engine.scheduler.kv_cache_manager.block_pool.free_block_queue.block_ids() == queue_before
    assert await (await client.get("/metrics")).text() == metrics_before


@pytest.mark.parametrize(
    "body", [{}, {"token_ids": [1], "chat": CHAT}, {"token_ids": ["a"]}, {"chat": {"messages": 3}}, [1]]
)
async def test_prefix_probe_rejects_bad_bodies(replica_client, body):
    client = await replica_client()
    response = await client.post("/v1/kvgate/prefix", json=body)
    assert response.status == 400 and "error" in await response.json()


async def wait_until(predicate, what: str, attempts: int = 500):
    for _ in range(attempts):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


@pytest.fixture
async def slow_replica():
    # 1 s per step: a request of many tokens stays running while the test disconnects.
    from kvgate.simulator.config import CostModel

    replica = await SimulatedReplica.start(
        "slow", cost_model=CostModel(step_overhead_s=1.0), time_scale=1.0, num_blocks=64, block_size=16
    )
    yield replica
    await replica.stop()


async def test_stream_disconnect_aborts_request(slow_replica):
    engine = slow_replica.engine
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            slow_replica.url + "/v1/chat/completions", json=CHAT | {"stream": True, "max_tokens": 500}
        )
        await response.content.readline()  # the role chunk: the request is in the engine
        assert len(engine.scheduler.running) + len(engine.scheduler.waiting) == 1
        response.close()
    await wait_until(lambda: engine.scheduler.counters.num_aborted == 1, "the stream's request is aborted")
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == 64


async def test_non_stream_disconnect_aborts_request(slow_replica):
    engine = slow_replica.engine
    async with aiohttp.ClientSession() as session:
        post = asyncio.ensure_future(
            session.post(slow_replica.url + "/v1/chat/completions", json=CHAT | {"max_tokens": 500})
        )
        await wait_until(lambda: engine.scheduler.has_unfinished_requests(), "the request reaches the engine")
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
    await wait_until(lambda: engine.scheduler.counters.num_aborted == 1, "the request is aborted")
    assert engine.scheduler.num_free_blocks == 64


async def test_start_simulated_replicas_binds_free_ports_and_stops():
    replicas = await start_simulated_replicas(2, time_scale=0.0, num_blocks=32)
    try:
        assert [r.name for r in replicas] == ["sim0", "sim1"]
        assert len({r.url for r in replicas}) == 2 and all(r.url.startswith("http://127.0.0.1:") for r in replicas)
        async with aiohttp.ClientSession() as session:
            for replica in replicas:
                kv = await (await session.get(replica.url + "/v1/kvgate/kv")).json()
                assert kv["num_total_blocks"] == 32
    finally:
        for replica in replicas:
            await replica.stop()
    with pytest.raises(TypeError, match="num_blockz"):
        await start_simulated_replicas(1, num_blockz=3)


async def run_sessions(client, num_sessions: int, num_turns: int) -> dict:
    """Round-robin multi-turn sessions: each turn resends the history plus a new tool result."""
    histories = [
        [{"role": "system", "content": f"session {s}: " + "you are a coding agent " * 60}] for s in range(num_sessions)
    ]
    for turn in range(num_turns):
        for s, history in enumerate(histories):
            history.append({"role": "user", "content": f"tool result {turn} for {s}: " + "ok " * 40})
            reply = await (
                await client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 8})
            ).json()
            history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    text = await (await client.get("/metrics")).text()
    return {
        "hit_rate": metric(text, "vllm:prefix_cache_hits_total") / metric(text, "vllm:prefix_cache_queries_total"),
        "evictions": metric(text, "kvgate_sim:evictions_total"),
    }


async def test_multi_turn_sessions_hit_when_they_fit_and_thrash_when_they_outgrow_the_cache(replica_client):
    fit = await run_sessions(await replica_client(num_blocks=512, block_size=16), num_sessions=2, num_turns=8)
    thrash = await run_sessions(await replica_client(num_blocks=128, block_size=16), num_sessions=8, num_turns=8)
    assert fit["hit_rate"] > 0.8 and fit["evictions"] == 0
    assert thrash["hit_rate"] < 0.2 and thrash["evictions"] > 100


async def test_priority_is_vllms_request_field_and_the_kv_answer_names_the_policy(replica_client):
    client = await replica_client(num_blocks=64, block_size=16, scheduling_policy="priority")
    kv = await (await client.get("/v1/kvgate/kv")).json()
    assert kv["scheduling_policy"] == "priority"
    served = await client.post("/v1/chat/completions", json={**CHAT, "priority": 3})
    assert served.status == 200
    refused = await client.post("/v1/chat/completions", json={**CHAT, "priority": "low"})
    assert refused.status == 400 and (await refused.json())["error"]["param"] == "priority"
