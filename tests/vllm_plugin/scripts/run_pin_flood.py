"""Measure KV pins on a real vLLM CPU server: does a pinned window survive a flood?

    .venv/bin/python tests/vllm_plugin/scripts/run_pin_flood.py [--out FILE]
        [--url URL --model NAME --replica-key KEY --api-key KEY]

One session's window is sent pinned (the gate's pin, proved with the replica key), another
session's unpinned; then other sessions' prompts flood the cache three times over, and the
prefix probe reads how much of each window is still resident (`measure_flood` in
tests/pin_sequence.py, the measure the results page shows). Also counted: the engine's
preemptions during the run (`vllm:num_preemptions_total`; a pin must never cause one).

Without `--url` it provisions what tests/vllm_plugin provisions (the vLLM CPU venv,
`KVGATE_VLLM_VENV` overrides its path, and the tiny random-weight model under
~/.cache/kvgate/models), starts one server with the kvgate plugin, its retention connector
(`--kv-transfer-config`) and a fresh replica key, measures, and stops it (also on failure
or Ctrl-C). With `--url` it measures that server, which must be idle, keep pins and hold
none. Prints the figures; `--out` also writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import secrets
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/vllm_plugin: the harness
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo: tests.pin_sequence

import aiohttp  # noqa: E402
from vllm_harness import (  # noqa: E402
    TEST_LAYOUT_ARGS,
    TEST_LAYOUT_ENV,
    VllmServer,
    ensure_tiny_model,
    ensure_vllm_venv,
    preemptions,
)

from kvgate.vllm_plugin.pin_keeper import CONNECTOR_CONFIG  # noqa: E402
from kvgate.wire.replica_auth import REPLICA_KEY_HEADER  # noqa: E402
from tests.pin_sequence import PinReplica, _Client, measure_flood  # noqa: E402


def replica_of(url: str, model: str, replica_key: str | None, api_key: str | None) -> PinReplica:
    """The server as the pin client sees it: the headers a gate sends, and its preemption count."""
    headers = {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if replica_key:
        headers[REPLICA_KEY_HEADER] = replica_key
    return PinReplica(url, model, headers, replica_key, functools.partial(preemptions, url))


async def measure(replica: PinReplica) -> dict:
    """`measure_flood` on the server, refused (ValueError) where it keeps no pins or holds some."""
    async with aiohttp.ClientSession() as http:
        client = _Client(replica, http)
        kv = await client.kv()
        if kv.num_pinned_sessions is None:
            raise ValueError(f"{replica.url} keeps no KV pins: start vLLM with --kv-transfer-config {CONNECTOR_CONFIG}")
        if kv.num_pinned_sessions:
            raise ValueError(f"{replica.url} holds {kv.num_pinned_sessions} pinned sessions: measure an idle server")
        if not kv.num_total_blocks or not kv.block_size:
            raise ValueError(f"{replica.url}'s kv answer has no block counts: {kv}")
        return await measure_flood(client, kv.num_total_blocks, kv.block_size)


def measure_own_server(log_dir: Path) -> tuple[str, dict]:
    """Start the tiny model's server with the retention connector and a fresh replica key,
    measure it, stop it; (what ran, the figures)."""
    python = ensure_vllm_venv()
    model_dir = ensure_tiny_model(python)
    key = secrets.token_hex(16)
    key_file = log_dir / "replica.key"
    key_file.write_text(key + "\n")
    server = VllmServer(
        python=python,
        model_dir=model_dir,
        log_path=log_dir / "vllm.log",
        served_model_name="tiny",
        extra_args=TEST_LAYOUT_ARGS + ("--kv-transfer-config", CONNECTOR_CONFIG),
        extra_env=TEST_LAYOUT_ENV + (("KVGATE_REPLICA_API_KEY_FILE", str(key_file)),),
    )
    try:
        server.start()
        print(f"[run_pin_flood] vLLM at {server.url} (log {server.log_path})", flush=True)
        figures = asyncio.run(measure(replica_of(server.url, "tiny", key, None)))
    finally:
        server.stop()
    usable = f"{figures['num_total_blocks']} blocks of {figures['block_size']} tokens"
    return f"vLLM CPU, the tiny model ({usable})", figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--url", default=None, help="measure this running server instead of starting one")
    parser.add_argument("--model", default="tiny", help="the served model name at --url (default tiny)")
    parser.add_argument("--replica-key", default=None, help="the replica key the server at --url proves pins with")
    parser.add_argument("--api-key", default=None, help="vLLM's client key at --url (VLLM_API_KEY), if it has one")
    args = parser.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the server is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.url is None:
            server, figures = measure_own_server(Path(tempfile.mkdtemp(prefix="kvgate-pin-flood-")))
        else:
            server = args.url
            figures = asyncio.run(measure(replica_of(args.url, args.model, args.replica_key, args.api_key)))
    except ValueError as exc:
        print(f"run_pin_flood: {exc}", file=sys.stderr)
        return 2
    document = {"server": server, **figures}
    print(
        f"[run_pin_flood] window of {figures['window_blocks']} blocks, flood of {figures['flood_turns']} x "
        f"{figures['flood_blocks']}: pinned hit {figures['pinned_hit']:.2f}, unpinned {figures['unpinned_hit']:.2f}, "
        f"preemptions {figures['preemptions']}",
        flush=True,
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
