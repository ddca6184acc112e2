"""KV pins on a real vLLM CPU server with the retention connector and a replica key (the
session's keyed server, conftest.keyed_server): the
scripted sequence every pin-keeping server must pass (tests/pin_sequence.py), with
vLLM's own preemption counter showing no pin ever caused a preemption."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from keyed_server import GATE, REPLICA_KEY, VLLM_KEY
from vllm_harness import VllmServer, http_json, preemptions

from tests.pin_sequence import PinReplica, _Client, run_pin_sequence

pytestmark = pytest.mark.vllm

FLOOD_SCRIPT = Path(__file__).resolve().parent / "scripts" / "run_pin_flood.py"


def replica(server: VllmServer) -> PinReplica:
    return PinReplica(server.url, "tiny", GATE, REPLICA_KEY, functools.partial(preemptions, server.url))


async def test_the_connector_passes_the_pin_sequence_without_a_preemption(keyed_server):
    async with aiohttp.ClientSession() as http:
        await run_pin_sequence(replica(keyed_server), http)


def test_a_pinned_window_hits_whole_after_a_flood_and_an_unpinned_one_does_not(keyed_server, tmp_path):
    """The issue's measure, as the results page runs it (scripts/run_pin_flood.py, here with
    `--url` on the keyed server): after a flood of other sessions three times the cache, a
    pinned window hits whole and an unpinned one not at all, with no preemption."""
    out = tmp_path / "flood.json"
    command = [sys.executable, str(FLOOD_SCRIPT), "--url", keyed_server.url, "--out", str(out)]
    command += ["--replica-key", REPLICA_KEY, "--api-key", VLLM_KEY]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    print(done.stdout)
    figures = json.loads(out.read_text())
    assert (figures["pinned_hit"], figures["unpinned_hit"], figures["preemptions"]) == (1.0, 0.0, 0)
    assert figures["flood_turns"] * figures["flood_blocks"] >= 3 * figures["num_total_blocks"]


def test_the_flood_script_refuses_a_server_that_keeps_no_pins(vllm_server):
    done = subprocess.run(
        [sys.executable, str(FLOOD_SCRIPT), "--url", vllm_server.url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "keeps no KV pins" in done.stderr and "--kv-transfer-config" in done.stderr


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "pin me " * 40}]}),
        ("/v1/responses", {"max_output_tokens": 16, "input": "pin me " * 40}),
    ],
    ids=["messages", "responses"],
)
async def test_vllm_keeps_a_pin_sent_on_the_anthropic_and_responses_routes(keyed_server, path, body):
    """The gate pins on every prompt route (gate.pins.PIN_ROUTE_KINDS): vLLM hands the
    body's `kv_transfer_params` of an Anthropic messages or a Responses turn to the
    connector as it does a chat turn's, and the connector keeps the pin."""
    async with aiohttp.ClientSession() as http:
        client = _Client(replica(keyed_server), http)
        pin = client.pin(f"route-{path}")
        sent = {"model": "tiny", **body, "kv_transfer_params": {"kvgate_pin": pin.to_json()}}
        async with http.post(keyed_server.url + path, json=sent, headers=client.replica.headers) as resp:
            assert resp.status == 200, await resp.text()
        assert (await client.kv()).num_pinned_sessions == 1
        released = await client.release(pin.session)
    assert released.released_sessions == 1 and released.released_blocks > 0


def test_a_server_without_the_connector_answers_a_release_501_naming_it(vllm_server):
    """The session's plain server (no --kv-transfer-config, no replica key) keeps no pins: a
    gate's release says how to load the connector (the keyed server above has it)."""
    status, answer = http_json("POST", vllm_server.url + "/v1/kvgate/release", {"sessions": ["a"]})
    assert (status, answer["error"]["code"]) == (501, "pins_not_kept") and "--kv-transfer-config" in str(answer)
