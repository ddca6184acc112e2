"""Probe latency: how long a replica takes to answer the gate's probes, idle and under load.

`kvgate bench probe-latency --url URL` times `--samples` sequential `GET /v1/kvgate/kv`
and `POST /v1/kvgate/prefix` calls (the probe API, docs/reference.md) against one server with the
probe API (a vLLM server with the `vllm_plugin` plugin, or `kvgate replica`): first with
the server idle, then while `--load-clients` clients keep sending completions
(`--load-prompt-tokens` random token ids, `--load-max-tokens` generated tokens each).
The prefix probe carries a chat body of `--prompt-words` random words (rendered by the
server, as the gate's probes are).

It prints p50, p95 and max per probe and phase (and writes them with `--out`), and
asserts no number: timings on a shared machine are noisy, and the point is their size
next to `gate.probe.timeout_sec`. The exit status is 1 only when a probe did not answer
200, a load request failed, or the load never had a request running while the probes
were timed (then the "under load" numbers would not be under load). docs/bench.md,
Probe latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvgate.simulator.percentiles import percentile
from kvgate.wire.probe_api import KV_PATH, PREFIX_PATH, KvAnswer, PrefixAnswer, PrefixQuery, ProbeAnswerError
from kvgate.wire.replica_auth import replica_headers, replica_key_from_env

PROBES = ("kv", "prefix")
WORDS = ("ka", "lo", "mirenso", "tovel", "dorin", "exqu")


class ProbeFailed(RuntimeError):
    """A probe answered other than 200: the server is not measurable as it is."""


@dataclass
class Phase:
    """One phase's probe latencies (milliseconds, in call order) and what the kv probe saw."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in PROBES})
    max_running: int = 0  # the most requests the kv probe saw running during the phase


def summarize(latencies: list[float]) -> dict[str, float | int | None]:
    return {
        "samples": len(latencies),
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "max_ms": max(latencies, default=None),
    }


async def _call(http: aiohttp.ClientSession, method: str, url: str, body: dict | None) -> dict:
    async with http.request(method, url, json=body) as response:
        if response.status != 200:
            raise ProbeFailed(f"{method} {url} answered {response.status}: {(await response.text())[:200]}")
        return await response.json(content_type=None)


async def timed_probes(http: aiohttp.ClientSession, url: str, chat: dict, samples: int) -> Phase:
    """`samples` rounds of one kv probe then one prefix probe, one call at a time."""
    phase = Phase()
    query = PrefixQuery.of_request("chat", chat).to_json()
    calls = (("kv", "GET", url + KV_PATH, None), ("prefix", "POST", url + PREFIX_PATH, query))
    for _ in range(samples):
        for name, method, target, body in calls:
            started = time.perf_counter()
            answer = await _call(http, method, target, body)
            phase.latencies[name].append((time.perf_counter() - started) * 1000)
            parsed = KvAnswer.parse(answer) if name == "kv" else PrefixAnswer.parse(answer)  # a valid answer
            if isinstance(parsed, KvAnswer):
                phase.max_running = max(phase.max_running, parsed.num_running or 0)
    return phase


async def _load_client(
    http: aiohttp.ClientSession, url: str, body: dict, rng: random.Random, stop: asyncio.Event, statuses: list[int]
) -> None:
    """Send completions back to back until `stop`: fresh random prompts, so none is a prefix-cache hit."""
    prompt_tokens = len(body["prompt"])
    while not stop.is_set():
        request = {**body, "prompt": [rng.randrange(10, 500) for _ in range(prompt_tokens)]}
        async with http.post(url + "/v1/completions", json=request) as response:
            await response.read()
            statuses.append(response.status)


async def served_model(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


@dataclass(frozen=True)
class Options:
    url: str
    samples: int = 40
    load_clients: int = 6
    load_prompt_tokens: int = 300
    load_max_tokens: int = 64
    prompt_words: int = 900
    model: str | None = None  # None: the first model of /v1/models
    seed: int = 0


async def measure(options: Options) -> dict:
    """Run both phases against `options.url`; the results as a JSON-able dict.

    Raises ProbeFailed when a probe does not answer 200, ProbeAnswerError when its answer is
    not a valid one. Every load client is stopped and awaited before it returns (or raises).
    """
    url = options.url.rstrip("/")
    rng = random.Random(options.seed)
    timeout = aiohttp.ClientTimeout(total=600)
    # a server with the replica key answers its probe API to that key only (docs/security.md)
    headers = replica_headers(None, replica_key_from_env(os.environ))
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
        model = options.model or await served_model(http, url)
        history = " ".join(rng.choice(WORDS) for _ in range(options.prompt_words))
        chat = {
            "model": model,
            "messages": [{"role": "system", "content": history}, {"role": "user", "content": "next"}],
        }
        query = PrefixQuery.of_request("chat", chat).to_json()
        prefix_tokens = PrefixAnswer.parse(await _call(http, "POST", url + PREFIX_PATH, query)).total_tokens
        idle = await timed_probes(http, url, chat, options.samples)

        stop = asyncio.Event()
        statuses: list[int] = []
        load_body = {
            "model": model,
            "prompt": [0] * options.load_prompt_tokens,
            "max_tokens": options.load_max_tokens,
            "ignore_eos": True,
        }
        clients = [
            asyncio.create_task(_load_client(http, url, load_body, random.Random(rng.random()), stop, statuses))
            for _ in range(options.load_clients)
        ]
        try:
            await asyncio.sleep(1.0)  # let the load reach the engine
            loaded = await timed_probes(http, url, chat, options.samples)
        finally:
            stop.set()
            results = await asyncio.gather(*clients, return_exceptions=True)
        load_errors = [repr(result) for result in results if isinstance(result, BaseException)]
        load_errors += [f"status {status}" for status in statuses if status != 200]
    return {
        "url": url,
        "model": model,
        "samples": options.samples,
        "prefix_probe_tokens": prefix_tokens,
        "idle": {name: summarize(idle.latencies[name]) for name in PROBES},
        "load": {name: summarize(loaded.latencies[name]) for name in PROBES},
        "load_clients": options.load_clients,
        "load_max_running": loaded.max_running,
        "load_requests": len(statuses),
        "load_failed_requests": len(load_errors),
        "load_errors": load_errors[:5],
    }


def format_table(result: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:7.1f}"

    lines = [
        f"probe latency at {result['url']} ({result['samples']} sequential samples per probe and phase; "
        f"prefix probe of a {result['prefix_probe_tokens']}-token chat body)",
        f"{'phase':<22} {'probe':<7} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7}",
    ]
    phases = (("idle", "idle"), ("load", f"load ({result['load_max_running']} running)"))
    for key, label in phases:
        for name in PROBES:
            row = result[key][name]
            lines.append(f"{label:<22} {name:<7} {ms(row['p50_ms'])} {ms(row['p95_ms'])} {ms(row['max_ms'])}")
    lines.append(
        f"load: {result['load_requests']} completions from {result['load_clients']} clients, "
        f"{result['load_failed_requests']} failed"
    )
    return "\n".join(lines)


def add_command(benchmarks) -> None:
    parser = benchmarks.add_parser(
        "probe-latency",
        help="time the probe API of one replica, idle and under load",
        description=f"Times GET {KV_PATH} and POST {PREFIX_PATH}, one call at a time, on an idle "
        "server and then while load clients keep it busy. Prints p50/p95/max; asserts none of them. "
        "Exit 1 when a probe or a load request failed, or nothing ran while the loaded probes did.",
    )
    defaults = Options(url="")
    parser.add_argument(
        "--url", required=True, help="the server: a vLLM server with the kvgate plugin, or `kvgate replica`"
    )
    parser.add_argument("--samples", type=int, default=defaults.samples, help="probes of each kind per phase")
    parser.add_argument("--load-clients", type=int, default=defaults.load_clients, help="concurrent load clients")
    parser.add_argument(
        "--load-prompt-tokens", type=int, default=defaults.load_prompt_tokens, help="prompt length of a load request"
    )
    parser.add_argument(
        "--load-max-tokens", type=int, default=defaults.load_max_tokens, help="tokens a load request generates"
    )
    parser.add_argument(
        "--prompt-words", type=int, default=defaults.prompt_words, help="words in the prefix probe's chat body"
    )
    parser.add_argument("--model", default=None, help="model name (default: the server's first model)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the random prompts")
    parser.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    parser.set_defaults(func=probe_latency_command)


def probe_latency_command(args: argparse.Namespace) -> int:
    for name in ("samples", "load_clients", "load_prompt_tokens", "load_max_tokens", "prompt_words"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    options = Options(
        url=args.url,
        samples=args.samples,
        load_clients=args.load_clients,
        load_prompt_tokens=args.load_prompt_tokens,
        load_max_tokens=args.load_max_tokens,
        prompt_words=args.prompt_words,
        model=args.model,
        seed=args.seed,
    )
    try:
        result = asyncio.run(measure(options))
    except (ProbeFailed, ProbeAnswerError, aiohttp.ClientError) as exc:
        print(f"probe-latency: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if result["load_failed_requests"]:
        print(f"probe-latency: load requests failed: {result['load_errors']}", file=sys.stderr)
        return 1
    if result["load_max_running"] == 0:
        print("probe-latency: no request was running while the loaded probes ran", file=sys.stderr)
        return 1
    return 0
