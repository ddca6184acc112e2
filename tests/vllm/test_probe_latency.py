"""Probe latency on the real server, idle and under load: printed, never asserted.

Run with ``-s`` to see the numbers. The only assertions are that every probe
answered 200 and that the load was really running while it was measured.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
import uuid

import pytest
from vllm_harness import http_json

pytestmark = pytest.mark.vllm

SAMPLES = 40


def timed_probes(server, payload: dict) -> dict[str, list[float]]:
    latencies: dict[str, list[float]] = {"kv": [], "prefix": []}
    for _ in range(SAMPLES):
        for name, method, path, body in (
            ("kv", "GET", "/v1/kvgate/kv", None),
            ("prefix", "POST", "/v1/kvgate/prefix", payload),
        ):
            started = time.perf_counter()
            status, answer = http_json(method, server.url + path, body)
            latencies[name].append((time.perf_counter() - started) * 1000)
            assert status == 200, answer
    return latencies


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return f"p50 {statistics.median(ordered):6.1f} ms  p95 {p95:6.1f} ms  max {ordered[-1]:6.1f} ms"


def test_probe_latency_idle_and_under_load(vllm_server):
    rng = random.Random(uuid.uuid4().hex)
    history = " ".join(rng.choice(["ka", "lo", "mirenso", "tovel", "dorin", "exqu"]) for _ in range(900))
    chat = {
        "model": "tiny",
        "messages": [{"role": "system", "content": history}, {"role": "user", "content": "next step"}],
    }
    payload = {"chat": chat}
    idle = timed_probes(vllm_server, payload)

    stop = threading.Event()
    served = []

    def load(index: int) -> None:
        while not stop.is_set():
            prompt = [rng.randrange(10, 500) for _ in range(300)]
            status, _ = http_json(
                "POST",
                vllm_server.url + "/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": 64, "ignore_eos": True},
            )
            served.append(status)

    threads = [threading.Thread(target=load, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)
        running = http_json("GET", vllm_server.url + "/v1/kvgate/kv")[1]["num_running"]
        loaded = timed_probes(vllm_server, payload)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert running > 0 and served and all(status == 200 for status in served)

    tokens = http_json("POST", vllm_server.url + "/v1/kvgate/prefix", payload)[1]["total_tokens"]
    print(f"\n[probe latency] {SAMPLES} sequential samples each, prefix probe of a {tokens}-token chat body")
    for label, latencies in (("idle", idle), (f"load ({running} running)", loaded)):
        for name in ("kv", "prefix"):
            print(f"[probe latency] {label:<18} {name:<6} {summary(latencies[name])}")
