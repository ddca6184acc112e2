"""vLLM's priority scheduling as the gate uses it, on the real vLLM CPU server: started with
`--scheduling-policy priority`, the plugin's kv answer says so, vLLM serves a request's
`priority` field, and kvgate (`gate.held_priority: 1`) forwards a turn it would hold at
low priority end to end: both sessions are served, nothing hangs. The server is the
session's keyed server (conftest.keyed_server), so the calls carry its keys.
"""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest
from keyed_server import CLIENT, GATE, REPLICA_KEY, VLLM_KEY
from server_calls import words
from vllm_harness import KvgateProxy, VllmServer, free_port, http_json

from kvgate.wire.probe_api import KV_PATH

pytestmark = pytest.mark.vllm

MODEL = "tiny"


def test_the_kv_answer_names_the_policy_and_vllm_serves_the_priority_field(keyed_server):
    status, kv = http_json("GET", keyed_server.url + KV_PATH, headers=GATE)
    assert status == 200 and kv["scheduling_policy"] == "priority", kv
    body = {"model": MODEL, "prompt": words(20, "prio"), "max_tokens": 4, "priority": 5}
    status, answer = http_json("POST", keyed_server.url + "/v1/completions", body, headers=CLIENT)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer


def running(server: VllmServer) -> int:
    """Requests running in the server's engine now (its kv answer)."""
    status, kv = http_json("GET", server.url + KV_PATH, headers=GATE)
    assert status == 200, kv
    return kv["num_running"]


def test_kvgate_forwards_a_turn_it_would_hold_at_low_priority(keyed_server, tmp_path):
    """a's window is priced at its ~240-token prompt and its 1,700-token output allowance
    (61 of 63 blocks of 32); while a decodes, b (8 blocks) fits vLLM's free blocks but not
    the windows' books: the gate would hold it (the work-conserving rule is off), and
    forwards it at priority 1 instead. Both are served in full."""
    keyed_server.reset_prefix_cache()
    config = tmp_path / "kvgate.yaml"
    proxy = KvgateProxy(config_path=config, log_path=tmp_path / "kvgate.log", port=free_port())
    # pins off: the server keeps pins, and a's pinned window would outlive the test (here the
    # gate's priority is under test, not its pins: tests/vllm_plugin/test_pins_on_vllm.py)
    gate = {"mode": "enforce", "policy": "working_set", "work_conserving": False, "held_priority": 1, "pins": "off"}
    keys = {"api_key": VLLM_KEY, "replica_api_key": REPLICA_KEY}
    KvgateProxy.write_config(config, proxy.port, keyed_server.url, {**gate, "probe": {"timeout_sec": 5.0}}, keys)
    proxy.start()
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=300)

    def turn(session: str, max_tokens: int) -> tuple[str, int]:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{session}: " + words(150, session)}],
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
            extra_headers={"x-session-id": session},
        )
        return raw.headers["x-kvgate-admission"], raw.parse().usage.completion_tokens

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(turn, "a", 1700)
            deadline = time.monotonic() + 120
            while not running(keyed_server) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert running(keyed_server), "a never ran: " + proxy.log_tail()
            second = turn("b", 8)
            assert first.result(timeout=300) == ("window_fits", 1700)
        assert second == ("low_priority", 8), proxy.log_tail()
    finally:
        client.close()
        proxy.stop()
