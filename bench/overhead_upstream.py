"""The overhead benchmark's upstream: a vLLM stand-in that answers at once.

`POST /v1/chat/completions` (and `/v1/completions`) answer a fixed small JSON body,
or, with `"stream": true`, STREAM_CHUNKS SSE events and `data: [DONE]`, written as
separate chunks with no delay. `/health`, `/metrics` and the probes (`GET /v1/kvgate/kv`,
`POST /v1/kvgate/prefix`) report an idle replica with an empty prefix cache, so a gate
in front of it admits everything, and each policy pays exactly its probes. `--kv-blocks`
and `--kv-used` size its KV cache and the share of it in use (a calm replica: room for
every window of thousands of sessions, `kvgate bench overhead --sessions`).
Built on aiohttp's low-level server (no router) under uvloop, to spend as little of
the shared CPUs as possible. Prints `READY <port>` once listening.

Run: python -m kvgate.bench.overhead_upstream [--host H] [--port P]
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import orjson
from aiohttp import web

from kvgate.wire.probe_api import KV_PATH, PREFIX_PATH, KvAnswer, PrefixAnswer, merge_kv, merge_prefix

STREAM_CHUNKS = 20

_FULL = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 16}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
    }
)
_CHUNK = (
    b"data: "
    + orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "bench",
            "choices": [{"index": 0, "delta": {"content": "ok "}, "finish_reason": None}],
        }
    )
    + b"\n\n"
)
_DONE = b"data: [DONE]\n\n"
DEFAULT_KV_BLOCKS = 4097


def kv_answer(blocks: int, used: float) -> bytes:
    """The kv probe's answer of a replica with `blocks` KV blocks, a share `used` of them in
    use (at least the one vLLM reserves), an empty prefix cache and nothing running, built as
    the probe API's servers build theirs."""
    free = min(blocks - 1, int(blocks * (1.0 - used)))
    engine = KvAnswer.of_engine(
        num_gpu_blocks=blocks, num_free_blocks=free, num_cached_blocks=0, block_size=16, num_running=0, num_waiting=0
    )
    return orjson.dumps(merge_kv([engine]).to_json())


_KV = kv_answer(DEFAULT_KV_BLOCKS, 0.0)  # an idle replica
_PREFIX = orjson.dumps(
    merge_prefix(
        [PrefixAnswer.of_engine(total_tokens=8, block_size=16, hit_block_ref_counts=[], hit_tokens=0)]
    ).to_json()
)
_METRICS = (
    b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.0\n"
    b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
)


async def handle(request: web.BaseRequest) -> web.StreamResponse:
    path = request.path
    if request.method == "POST":
        body = await request.read()
        if path == PREFIX_PATH:
            return web.Response(body=_PREFIX, content_type="application/json")
        if b'"stream":true' in body.replace(b" ", b""):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(STREAM_CHUNKS):
                await response.write(_CHUNK)
            await response.write(_DONE)
            await response.write_eof()
            return response
        return web.Response(body=_FULL, content_type="application/json")
    if path == KV_PATH:
        return web.Response(body=_KV, content_type="application/json")
    if path == "/metrics":
        return web.Response(body=_METRICS, content_type="text/plain")
    if path == "/v1/models":
        return web.Response(
            body=b'{"object":"list","data":[{"id":"bench","object":"model"}]}', content_type="application/json"
        )
    return web.Response(text="ok")  # /health and anything else


async def main(host: str, port: int) -> None:
    server = web.Server(handle, access_log=None)
    loop = asyncio.get_running_loop()
    tcp = await loop.create_server(server, host, port, backlog=2048, reuse_address=True)
    print(f"READY {tcp.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    tcp.close()
    await server.shutdown(1)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kv-blocks", type=int, default=DEFAULT_KV_BLOCKS, help="KV-cache blocks it reports")
    parser.add_argument("--kv-used", type=float, default=0.0, help="share of them it reports in use (0..1)")
    args = parser.parse_args()
    global _KV
    _KV = kv_answer(args.kv_blocks, args.kv_used)
    from kvgate.proxy.event_loop import run

    run(main(args.host, args.port))


if __name__ == "__main__":
    cli()
