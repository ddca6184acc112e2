"""Calls the vLLM tests make on a served model: prompts, probes, requests, settled counters.

Each call asserts that the server answered 200 and returns the answer's JSON.
"""

from __future__ import annotations

import random
import time

from vllm_harness import http_json, prefix_counters

MODEL = "tiny"


def words(count: int, seed: object) -> str:
    rng = random.Random(str(seed))
    syllables = ["ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "in", "ex", "qu", "ab", "ze", "pol"]
    return " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(count))


def token_prompt(num_tokens: int, seed: object) -> list[int]:
    rng = random.Random(str(seed))
    return [rng.randrange(10, 500) for _ in range(num_tokens)]


def chat_body(system: str, user: str, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }
    body.update(extra)
    return body


def anthropic_prompt(usage) -> int:
    """A Messages answer's whole prompt: Anthropic's `input_tokens` leaves out the tokens
    read from or written to the prompt cache, which vLLM started with
    --enable-prompt-tokens-details reports apart."""
    return usage.input_tokens + (usage.cache_creation_input_tokens or 0) + (usage.cache_read_input_tokens or 0)


def probe_prefix(server, payload: dict) -> dict:
    status, body = http_json("POST", server.url + "/v1/kvgate/prefix", payload)
    assert status == 200, body
    return body


def probe_kv(server) -> dict:
    status, body = http_json("GET", server.url + "/v1/kvgate/kv")
    assert status == 200, body
    return body


def serve(server, route: str, body: dict) -> dict:
    status, response = http_json("POST", server.url + route, body)
    assert status == 200, response
    return response


def chat_tokens(server, body: dict) -> list[int]:
    status, response = http_json("POST", server.url + "/tokenize", {"model": MODEL, "messages": body["messages"]})
    assert status == 200, response
    return response["tokens"]


def settled_counters(server) -> tuple[float, float]:
    """Prefix-cache counters once the last request's stats have reached /metrics."""
    previous = prefix_counters(server.url)
    for _ in range(20):
        time.sleep(0.25)
        current = prefix_counters(server.url)
        if current == previous:
            return current
        previous = current
    return previous
