"""KV pins end to end: the real proxy and gate before a simulated replica that keeps pins,
with the replica key. A turn the gate admits with a window is pinned in the engine; the
session's end releases it; a client's own `kvgate_pin` never reaches the replica (only
gates pin), while its other `kv_transfer_params` are kept. Nothing is left behind."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson
import pytest

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.request_body import with_kv_pin, without_kv_pin
from kvgate.proxy.settings import Settings, UpstreamSettings
from kvgate.simulator.replica_server import start_simulated_replicas
from kvgate.wire.kv_pins import make_pin

KEY = "the-replica-key"
CONTEXT = "tool output line\n" * 40


@contextlib.asynccontextmanager
async def pinning_stack(gate: GateSettings):
    (replica,) = await start_simulated_replicas(1, time_scale=0.0, num_blocks=256, block_size=16, replica_api_key=KEY)
    settings = Settings(
        replicas=(ReplicaSettings(replica.name, replica.url),),
        gate=gate,
        upstream=UpstreamSettings(replica_api_key=KEY),
    )
    app = create_app(settings, health_checks=False)
    try:
        host, port = await app.start("127.0.0.1", 0)
        async with aiohttp.ClientSession(base_url=f"http://{host}:{port}") as http:
            yield app, http, replica.engine.scheduler.kv_cache_manager.pins
    finally:
        await app.close()
        await replica.stop()


# Every prompt route, as a client of each API sends a turn to it (vLLM takes
# `kv_transfer_params` on all four).
ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": CONTEXT}], "max_tokens": 4}),
    "completion": ("/v1/completions", {"prompt": CONTEXT, "max_tokens": 4}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": CONTEXT}], "max_tokens": 4}),
    "responses": ("/v1/responses", {"input": CONTEXT, "max_output_tokens": 16}),
}


async def turn(http: aiohttp.ClientSession, session: str, finish: bool = False, route: str = "chat", **fields) -> str:
    path, fields_of_route = ROUTES[route]
    body = {"model": "kvgate-sim", **fields_of_route, **fields}
    headers = {"x-session-id": session, **({"x-session-finish": "true"} if finish else {})}
    async with http.post(path, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvgate-admission"]


async def until_released(pins) -> None:
    for _ in range(200):
        if pins.num_pinned_sessions == 0:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the pin was not released: {pins.num_pinned_sessions} sessions pinned")


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_the_gate_pins_a_window_and_releases_it_when_the_session_ends(route):
    async with pinning_stack(GateSettings()) as (app, http, pins):
        assert await turn(http, "a", route=route) in ("window_fits", "holds_window")  # no pins known yet
        assert await turn(http, "a", route=route) == "holds_window"
        assert pins.num_pinned_sessions == 1 and pins.pinned("a") is not None and pins.num_pinned_blocks > 0
        await turn(http, "a", finish=True, route=route)
        await until_released(pins)
        counts = app.admission.counts()
        assert (counts["leases"], counts["waiters"], counts["attempts"]) == (0, 0, 0), counts


async def test_a_clients_pin_is_stripped_and_its_other_transfer_parameters_kept():
    forged = make_pin("someone", 600.0, KEY)  # even a valid proof: only gates pin
    async with pinning_stack(GateSettings(mode="off")) as (app, http, pins):
        params = {"kvgate_pin": forged.to_json(), "other": 1}
        await turn(http, "a", kv_transfer_params=params)
        await turn(http, "b", kv_transfer_params={"kvgate_pin": forged.to_json()})
        assert pins.num_pinned_sessions == 0


def test_the_body_rewrites_keep_the_clients_other_transfer_parameters():
    pin = make_pin("s", 30.0, KEY)
    body = {"model": "m", "kv_transfer_params": {"kvgate_pin": {"session": "x"}, "other": 1}}
    raw, stripped = without_kv_pin(orjson.dumps(body), body)
    assert stripped == orjson.loads(raw) == {"model": "m", "kv_transfer_params": {"other": 1}}
    assert orjson.loads(with_kv_pin(raw, stripped, pin))["kv_transfer_params"] == {
        "other": 1,
        "kvgate_pin": pin.to_json(),
    }
    plain = {"model": "m"}
    raw = b'{"model": "m"}'
    assert without_kv_pin(raw, plain) == (raw, plain)  # as sent: no pin named
    assert orjson.loads(with_kv_pin(raw, plain, pin)) == {
        "kv_transfer_params": {"kvgate_pin": pin.to_json()},
        "model": "m",
    }
