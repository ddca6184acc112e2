"""The overhead benchmark's load generator: closed-loop HTTP/1.1 clients in one process.

`--concurrency` workers, each on its own keep-alive connection, send the same chat
request back to back for `--duration` seconds (after `--warmup` seconds not
counted) and time each full response (the last byte of a stream). A minimal client
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


def build_request(host: str, port: int, stream: bool, session: str) -> bytes:
    body = orjson.dumps(
        {"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "stream": stream}
    )
    return (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer bench\r\nx-session-id: {session}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def worker(
    host: str, port: int, request: bytes, start: float, stop: float, latencies: list, errors: list
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop:
                return
            writer.write(request)
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


async def run(url: str, concurrency: int, duration: float, warmup: float, stream: bool) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    if host is None:
        raise ValueError(f"--url {url!r} names no host")
    now = time.perf_counter()
    start, stop = now + warmup, now + warmup + duration
    latencies: list[float] = []
    errors: list[str] = []
    await asyncio.gather(
        *(
            worker(host, port, build_request(host, port, stream, f"bench-{i}"), start, stop, latencies, errors)
            for i in range(concurrency)
        )
    )
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
    args = parser.parse_args()
    from kvgate.proxy.server import run as run_loop

    result = {}

    async def main():
        result.update(await run(args.url, args.concurrency, args.duration, args.warmup, args.stream))

    run_loop(main())
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    cli()
