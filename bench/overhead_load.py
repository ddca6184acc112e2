"""The overhead benchmark's load generator: closed-loop HTTP/1.1 clients in one process.

`--concurrency` workers, each on its own keep-alive connection, send the same chat
request back to back for `--duration` seconds (after `--warmup` seconds not
counted) and time each full response (the last byte of a stream). Each worker is one
session (`bench-<i>`), or with `--sessions N` the workers take the N sessions in turn
(session ids `bench-0` .. `bench-<N-1>`, round robin); `--prime` sends each of the N
sessions one request and stops (no warmup, every request counted); with `--body-kib N`
each request carries an agent's history of N KiB (tool calls and their results), and with
`--body-threads T` each session's requests take T threads' histories in turn (a main
agent and its subagents: the same history after a first message of their own). A minimal client
on asyncio streams under uvloop (bench/http1.py): it parses only the status line,
Content-Length or chunked framing, so the load generator costs little of the CPUs it shares with the
upstream and the router under test. Prints one JSON line:
{"requests", "errors", "error_kinds", "seconds", "rps", "p50_ms", "p99_ms"}.

Run: python -m kvgate.bench.overhead_load --url http://127.0.0.1:8000 [--stream] [--concurrency N] [--duration S]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from urllib.parse import urlsplit

import orjson

from kvgate.bench.http1 import read_response
from kvgate.simulator.percentiles import percentile

PATH = "/v1/chat/completions"


# One step of an agent's history in a `--body-kib` body: a reply that calls a tool, and the
# tool's result (about 4 KiB of text).
_TOOL_CALL = {
    "role": "assistant",
    "content": "Running the tests.",
    "tool_calls": [{"id": "call", "type": "function", "function": {"name": "bash", "arguments": '{"cmd":"make"}'}}],
}
_TOOL_RESULT = {"role": "tool", "tool_call_id": "call", "content": ("test_ok passed in 0.01s\n" * 180)[:4000]}


def chat_body(stream: bool, body_kib: int = 0, thread: int = 0) -> bytes:
    """The chat request's JSON: one user message, after an agent's history of tool calls and
    their results of at least `body_kib` KiB (0: none). Thread 0's first message is the
    user's; another `thread`'s is its own task (a subagent's), the rest the same."""
    first = {"role": "user", "content": "hello" if not thread else f"subagent {thread}: run the tests"}
    messages: list[dict] = [first]
    while body_kib and len(orjson.dumps(messages)) < body_kib * 1024:
        messages += [_TOOL_CALL, _TOOL_RESULT]
    return orjson.dumps({"model": "bench", "messages": messages, "max_tokens": 16, "stream": stream})


def request_head(host: str, port: int, session: str, body: bytes) -> bytes:
    """The head of one session's request carrying `body`, as the wire carries it."""
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer bench\r\nx-session-id: {session}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()


async def worker(
    host: str,
    port: int,
    requests: list[tuple[bytes, bytes]],
    start: float,
    stop: float,
    latencies: list,
    errors: list,
    once=False,
    interval: float = 0.0,
) -> None:
    """Send `requests` (each a head and its body, bodies shared between requests) in turn
    until `stop` (`once`: each one once). `interval` > 0: send
    the k-th request no earlier than `interval` * k seconds after the first (paced; a late
    answer is not made up for by a burst)."""
    reader, writer = await asyncio.open_connection(host, port)
    sent = 0
    due = time.perf_counter()
    try:
        while True:
            if interval > 0:
                due = max(due + interval, time.perf_counter()) if sent else due
                pause = due - time.perf_counter()
                if pause > 0:
                    await asyncio.sleep(pause)
            t0 = time.perf_counter()
            if t0 >= stop or (once and sent == len(requests)):
                return
            head, body = requests[sent % len(requests)]
            writer.write(head)
            writer.write(body)
            sent += 1
            try:
                status = (await read_response(reader)).status
            except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
                errors.append(type(exc).__name__)
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            t1 = time.perf_counter()
            if t0 >= start:
                if status == 200:
                    latencies.append(t1 - t0)
                else:
                    errors.append(f"status {status}")
    finally:
        writer.close()


def sessions_of(worker_index: int, concurrency: int, sessions: int | None) -> list[str]:
    """The session ids one worker takes in turn: its own, or its share of `sessions` (the
    workers together take every id once per round)."""
    if sessions is None:
        return [f"bench-{worker_index}"]
    return [f"bench-{i}" for i in range(worker_index, sessions, concurrency)]


def pacing_interval(workers: int, rate: float | None) -> float:
    """Seconds between one worker's requests so that `workers` together send `rate` requests
    per second (0: no pacing, each sends when answered)."""
    return workers / rate if rate else 0.0


async def run(
    url: str,
    concurrency: int,
    duration: float,
    warmup: float,
    stream: bool,
    sessions: int | None = None,
    prime: bool = False,
    rate: float | None = None,
    body_kib: int = 0,
    body_threads: int = 1,
) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    if host is None:
        raise ValueError(f"--url {url!r} names no host")
    if prime:
        warmup, duration = 0.0, float("inf")
    now = time.perf_counter()
    start, stop = now + warmup, now + warmup + duration
    latencies: list[float] = []
    errors: list[str] = []
    bodies = [chat_body(stream, body_kib, thread) for thread in range(body_threads)]  # shared by every session
    workers = [
        [
            (request_head(host, port, session, body), body)
            for session in sessions_of(i, concurrency, sessions)
            for body in bodies  # a session's threads take turns
        ]
        for i in range(concurrency)
    ]
    workers = [requests for requests in workers if requests]  # fewer sessions than clients: fewer workers
    interval = 0.0 if prime else pacing_interval(len(workers), rate)
    began = time.perf_counter()
    await asyncio.gather(
        *(worker(host, port, requests, start, stop, latencies, errors, prime, interval) for requests in workers)
    )
    if prime:
        duration = time.perf_counter() - began
    latencies.sort()
    kinds: dict[str, int] = {}
    for kind in errors:
        kinds[kind] = kinds.get(kind, 0) + 1
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "error_kinds": kinds,
        "seconds": duration,
        "rps": len(latencies) / duration,
        "p50_ms": percentile(latencies, 50, math.nan) * 1000,
        "p99_ms": percentile(latencies, 99, math.nan) * 1000,
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--sessions", type=int, help="session ids the workers take in turn (default: one per worker)")
    parser.add_argument("--prime", action="store_true", help="send each of the --sessions once, then stop")
    parser.add_argument(
        "--rate", type=float, help="requests per second, all workers together (default: each as fast as it is answered)"
    )
    parser.add_argument(
        "--body-kib",
        type=int,
        default=0,
        help="each request carries an agent's history of tool calls and results of this many KiB (default 0)",
    )
    parser.add_argument(
        "--body-threads",
        type=int,
        default=1,
        help="each session's requests take this many threads' histories in turn (a main agent and its "
        "subagents; default 1)",
    )
    args = parser.parse_args()
    if args.rate is not None and args.rate <= 0:
        parser.error(f"--rate must be > 0, got {args.rate}")
    if args.body_kib < 0:
        parser.error(f"--body-kib must be >= 0, got {args.body_kib}")
    if args.body_threads < 1:
        parser.error(f"--body-threads must be >= 1, got {args.body_threads}")
    from kvgate.proxy.event_loop import run as run_loop

    result = {}

    async def main():
        result.update(
            await run(
                args.url,
                args.concurrency,
                args.duration,
                args.warmup,
                args.stream,
                args.sessions,
                args.prime,
                args.rate,
                args.body_kib,
                args.body_threads,
            )
        )

    run_loop(main())
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    cli()
