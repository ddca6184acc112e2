"""The probe endpoints on a real vLLM CPU server (docs/reference.md).

All tests share one server (conftest.vllm_server). Tests that need a known cache
state reset vLLM's prefix cache first; the others use prompts no other test sends.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid

import pytest
from server_calls import (
    MODEL,
    chat_body,
    chat_tokens,
    probe_kv,
    probe_prefix,
    serve,
    settled_counters,
    token_prompt,
    words,
)
from vllm_harness import http_json, prefix_counters, scrape_metrics

pytestmark = pytest.mark.vllm

LONG_REQUEST_SEC = 600  # a deadline for requests that take seconds on an idle machine (see their test)


def test_kv_probe_block_totals_match_cache_config_info(vllm_server):
    kv = probe_kv(vllm_server)
    info = [labels for name, labels, _ in scrape_metrics(vllm_server.url) if name == "vllm:cache_config_info"]
    assert info, "vllm:cache_config_info missing from /metrics"
    assert kv["num_gpu_blocks"] == int(info[0]["num_gpu_blocks"]) == vllm_server.num_blocks
    assert kv["num_total_blocks"] == kv["num_gpu_blocks"] - 1  # vLLM's null block is not usable
    assert kv["block_size"] == int(info[0]["block_size"]) == vllm_server.block_size
    assert kv["version"] == 1 and [engine["engine"] for engine in kv["engines"]] == [0]


def test_kv_probe_measures_the_engines_speed(vllm_server):
    """The work-conserving rule's inputs (docs/gate.md): after requests ran, `/v1/kvgate/kv`
    reports a prefill throughput over a window of at least PREFILL_WINDOW_SEC, a decode step and
    a prefill share, read from vLLM's own counters, and the engine's busy share from its steps."""
    from kvgate.vllm_plugin.engine_rates import PREFILL_WINDOW_SEC

    probe_kv(vllm_server)  # opens a window (or a previous test did)
    started = time.monotonic()
    for index in range(3):
        serve(
            vllm_server,
            "/v1/chat/completions",
            chat_body(words(120, f"speed-{index}"), words(20, f"speed-q-{index}"), max_tokens=8),
        )
    time.sleep(max(0.0, PREFILL_WINDOW_SEC - (time.monotonic() - started)) + 0.5)
    for _ in range(20):  # the request metrics reach the API server's registry a moment after the answer
        kv = probe_kv(vllm_server)
        if kv.get("prefill_tokens_per_sec") and kv.get("decode_step_sec"):
            break
        time.sleep(0.25)
    assert kv["prefill_tokens_per_sec"] > 0 and kv["decode_step_sec"] > 0, kv
    assert 0.0 <= kv["prefill_share"] <= 1.0, kv
    # the engine's timed steps give its busy share: some steps ran, and it has idled since
    assert 0.0 < kv["busy_share"] < 1.0 and kv["engines"][0]["busy_share"] == kv["busy_share"], kv


def test_chat_prefix_hit_ratio_lifecycle(vllm_server):
    tag = uuid.uuid4().hex
    system = f"{tag} " + words(180, tag)
    first = chat_body(system, "first question " + words(20, tag + "q1"))
    before = probe_prefix(vllm_server, {"chat": first})
    assert before["total_blocks"] >= 3
    assert (before["hit_blocks"], before["hit_ratio"]) == (0, 0.0)

    serve(vllm_server, "/v1/chat/completions", first)
    after = probe_prefix(vllm_server, {"chat": first})
    assert after["hit_ratio"] == 1.0 and after["hit_blocks"] == after["total_blocks"]
    assert after["hit_blocks_evictable"] == after["hit_blocks"]  # nothing running holds them

    second = chat_body(system, "another question " + words(20, tag + "q2"))
    shared = 0
    for a, b in zip(chat_tokens(vllm_server, first), chat_tokens(vllm_server, second)):
        if a != b:
            break
        shared += 1
    other = probe_prefix(vllm_server, {"chat": second})
    assert other["hit_blocks"] == shared // vllm_server.block_size
    assert 0 < other["hit_blocks"] < other["total_blocks"]

    salted = probe_prefix(vllm_server, {"chat": dict(first, cache_salt="tenant-" + tag)})
    assert salted["total_blocks"] == after["total_blocks"] and salted["hit_blocks"] == 0


def test_token_ids_and_chat_probe_agree(vllm_server):
    tag = uuid.uuid4().hex
    body = chat_body(f"{tag} " + words(120, tag), "question")
    serve(vllm_server, "/v1/chat/completions", body)
    by_chat = probe_prefix(vllm_server, {"chat": body})
    by_tokens = probe_prefix(vllm_server, {"token_ids": chat_tokens(vllm_server, body), "model": MODEL})
    for key in ("total_tokens", "total_blocks", "hit_blocks", "hit_tokens"):
        assert by_chat[key] == by_tokens[key], key


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/chat/completions", chat_body("sys " + words(90, "tt1"), "hi " + words(10, "tt2"))),
        (
            "/v1/chat/completions",
            chat_body(
                "tools " + words(60, "tt3"),
                "call it",
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "read_file",
                            "description": "read",
                            "parameters": {"type": "object", "properties": {}},
                        },
                    }
                ],
                tool_choice="none",
            ),
        ),
        ("/v1/completions", {"model": MODEL, "prompt": words(150, "tt4"), "max_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": token_prompt(77, "tt5"), "max_tokens": 2}),
    ],
    ids=["chat", "chat-with-tools", "completion-text", "completion-token-ids"],
)
def test_total_tokens_equal_vllm_prompt_tokens(vllm_server, route, body):
    kind = "chat" if "chat" in route else "completion"
    probed = probe_prefix(vllm_server, {kind: body})
    response = serve(vllm_server, route, body)
    assert probed["total_tokens"] == response["usage"]["prompt_tokens"]
    assert probed["total_blocks"] == probed["total_tokens"] // vllm_server.block_size


def test_probes_leave_counters_and_eviction_order_alone(vllm_server):
    """Twenty probes of an old prompt change no counter and do not save it from eviction.

    After a reset, A (20 blocks) then B (20 blocks) are served and freed, so A is
    older in vLLM's LRU free queue. C (30 blocks) then has to evict part of A and
    none of B, unless a probe had touched A's blocks.
    """
    server = vllm_server
    server.reset_prefix_cache()
    tag = uuid.uuid4().hex
    block = server.block_size
    prompt_a, prompt_b, prompt_c = (
        token_prompt(n * block, tag + name) for n, name in ((20, "a"), (20, "b"), (30, "c"))
    )

    def complete(prompt):
        return serve(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})

    complete(prompt_a)
    complete(prompt_b)
    counters_before = settled_counters(server)
    for index in range(20):
        probe = probe_prefix(
            server, {"token_ids": prompt_a} if index % 2 else {"completion": {"model": MODEL, "prompt": prompt_a}}
        )
        assert probe["hit_blocks"] == 20
        probe_kv(server)
    time.sleep(0.5)
    assert prefix_counters(server.url) == counters_before

    complete(prompt_c)
    resident_a = probe_prefix(server, {"token_ids": prompt_a})
    resident_b = probe_prefix(server, {"token_ids": prompt_b})
    assert resident_b["hit_blocks"] == 20
    assert resident_a["hit_blocks"] < 20

    # The probe's hit_tokens is exactly what the scheduler then reuses.
    queries_before, hits_before = settled_counters(server)
    complete(prompt_b)
    queries_after, hits_after = settled_counters(server)
    assert queries_after - queries_before == len(prompt_b)
    assert hits_after - hits_before == resident_b["hit_tokens"] == 19 * block


def test_kv_usage_rises_while_requests_run_and_returns_to_zero(vllm_server):
    """Four long completions run at once: the KV probe sees one running with blocks in use, and,
    once all four are answered, a cache with nothing running and every block free (the finished
    requests' blocks cached). The deadlines are generous (a loaded 2-core machine runs these
    requests for minutes where an idle one takes seconds): only a state that never comes fails."""
    server = vllm_server
    tag = uuid.uuid4().hex
    answers: dict[int, object] = {}

    def long_request(index: int) -> None:
        body = {"model": MODEL, "prompt": token_prompt(100, f"{tag}{index}"), "max_tokens": 400, "ignore_eos": True}
        try:
            answers[index] = http_json("POST", server.url + "/v1/completions", body, timeout=LONG_REQUEST_SEC)[0]
        except Exception as error:  # a thread's exception would only be printed: keep it for the assert
            answers[index] = error

    threads = [threading.Thread(target=long_request, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    busy = None
    deadline = time.monotonic() + LONG_REQUEST_SEC
    while time.monotonic() < deadline and any(thread.is_alive() for thread in threads):
        kv = probe_kv(server)
        if kv["num_running"] > 0 and kv["kv_cache_usage"] > 0:
            busy = kv
            break
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=LONG_REQUEST_SEC)
    assert not any(thread.is_alive() for thread in threads), f"requests still running after {LONG_REQUEST_SEC}s"
    assert answers == {index: 200 for index in range(4)}, answers
    assert busy is not None, "never saw a running request in the KV probe"
    assert busy["num_free_blocks"] < busy["num_total_blocks"]

    # Every request is answered; the engine frees their blocks at its next step.
    idle = probe_kv(server)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
        idle["num_running"] == idle["num_waiting"] == idle["kv_cache_usage"] == 0
    ):
        time.sleep(0.1)
        idle = probe_kv(server)
    assert (idle["num_running"], idle["num_waiting"]) == (0, 0), idle
    assert idle["kv_cache_usage"] == 0.0, idle
    assert idle["num_free_blocks"] == idle["num_total_blocks"], idle
    assert idle["num_cached_blocks"] > 0  # the finished requests' blocks stay cached


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b"{}",
        b'{"token_ids": "abc"}',
        b'{"token_ids": [1, "a"]}',
        b'{"token_ids": []}',
        b'{"token_ids": [1, 2], "cache_salt": 5}',
        b'{"token_ids": [1, 2], "model": "no-such-model"}',
        b'{"token_ids": [1, 2], "chat": {"messages": []}}',
        b'{"chat": "hello"}',
        b'{"chat": {"messages": "hello"}}',
        b'{"chat": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}}',
        b'{"chat": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]}}',
        b'{"completion": {"prompt": 5}}',
        b'{"completion": {"prompt": ["a", "b"]}}',
    ],
)
def test_bad_prefix_bodies_get_400(vllm_server, raw):
    status, body = http_json("POST", vllm_server.url + "/v1/kvgate/prefix", raw=raw)
    assert status == 400, body
    assert body["error"]["message"]


def test_server_still_answers_after_bad_bodies(vllm_server):
    http_json("POST", vllm_server.url + "/v1/kvgate/prefix", raw=b'{"token_ids": [1, "a"]}')
    assert probe_kv(vllm_server)["version"] == 1


VOCABULARY_LONGEST = """
import sys
from transformers import AutoTokenizer
vocabulary = AutoTokenizer.from_pretrained(sys.argv[1]).get_vocab()
print(max(len(token.encode("utf-8")) for token in vocabulary))
"""

# Texts whose tokens stand for the most bytes: long whitespace runs, code, multi-byte scripts.
FLOOR_TEXTS = (
    "plain words of an ordinary english sentence, " * 8,
    " " * 600 + "x",
    "\n" * 300 + "y",
    "def f(x):\n        return x  # indented\n" * 10,
    "日本語のテキストは一文字が三バイトです。" * 10,
    "emoji 😀🎉🚀 " * 30,
    "\u1100\u1161\u11a8" * 60,
)


def test_kv_probe_reports_the_servers_prompt_limits(vllm_server):
    """The plugin reports the server's max_model_len and its vocabulary's longest token (as the
    tokenizer the server loads computes it), and no text renders to fewer tokens than the
    bound the gate draws from them (vLLM's own /tokenize and prefix probe count)."""
    from kvgate.gate.request_body import prompt_token_floor, user_text_bytes

    kv = probe_kv(vllm_server)
    assert kv["max_model_len"] == vllm_server.max_model_len
    longest = subprocess.run(
        [str(vllm_server.python), "-c", VOCABULARY_LONGEST, str(vllm_server.model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()[-1]
    max_token_bytes = kv["max_token_bytes"]
    assert max_token_bytes == int(longest)
    assert all(engine["max_token_bytes"] is None and engine["max_model_len"] is None for engine in kv["engines"])
    for text in FLOOR_TEXTS:
        status, tokenized = http_json(
            "POST", vllm_server.url + "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False}
        )
        assert status == 200, tokenized
        # no token stands for more than max_token_bytes bytes: the bound holds without any margin
        assert tokenized["count"] * max_token_bytes >= len(text.encode("utf-8")), text[:40]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        rendered = probe_prefix(vllm_server, {"chat": chat})["total_tokens"]
        assert rendered >= prompt_token_floor(user_text_bytes("chat", chat), max_token_bytes), text[:40]
