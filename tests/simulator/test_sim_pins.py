"""KV pins in the simulated engine (`kvgate.wire.kv_pins`): the scripted sequence every
server that keeps pins must pass, over HTTP against a real `kvgate replica` server, and
the engine rules the sequence cannot see from outside (a pin yields to a running
request's next block instead of preempting it; pins taken and released per block)."""

from __future__ import annotations

import aiohttp
import pytest

from kvgate.simulator.config import EngineConfig
from kvgate.simulator.replica_server import SimulatedReplica
from kvgate.simulator.request import SimRequest
from kvgate.simulator.scheduler import Scheduler
from kvgate.wire.kv_pins import RELEASE_PATH
from kvgate.wire.replica_auth import REPLICA_KEY_HEADER
from tests.pin_sequence import PinReplica, run_pin_sequence

BLOCK = 16


@pytest.mark.parametrize("replica_key", ["the-replica-key", None])
async def test_the_simulated_replica_passes_the_pin_sequence(replica_key):
    replica = await SimulatedReplica.start(num_blocks=64, block_size=BLOCK, time_scale=0, replica_api_key=replica_key)
    counters = replica.engine.scheduler.counters

    async def preemptions() -> float:
        return counters.num_preemptions

    headers = {REPLICA_KEY_HEADER: replica_key} if replica_key else {}
    try:
        async with aiohttp.ClientSession() as http:
            # the simulated replica answers at once: a pin of 0.3 s is still held when read back
            pins = PinReplica(replica.url, "kvgate-sim", headers, replica_key, preemptions, short_ttl_sec=0.3)
            await run_pin_sequence(pins, http)
    finally:
        await replica.stop()


async def test_the_release_route_is_guarded_by_the_replica_key():
    replica = await SimulatedReplica.start(num_blocks=64, block_size=BLOCK, time_scale=0, replica_api_key="k")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(replica.url + RELEASE_PATH, json={"sessions": ["a"]}) as resp:
                assert resp.status == 401
            headers = {REPLICA_KEY_HEADER: "k"}
            async with http.post(replica.url + RELEASE_PATH, json={"sessions": "a"}, headers=headers) as resp:
                assert resp.status == 400 and "sessions" in (await resp.json())["error"]["message"]
    finally:
        await replica.stop()


def _finish(scheduler: Scheduler, request: SimRequest, now: float = 0.0) -> None:
    """Step until `request` finished."""
    scheduler.add_request(request)
    while request.request_id in scheduler.requests:
        scheduler.update_from_output(scheduler.schedule(now), lambda r: 7, now)


def test_a_pin_yields_to_a_running_requests_next_block_instead_of_preempting_it():
    scheduler = Scheduler(EngineConfig(num_blocks=8, block_size=4, max_model_len=32))
    pinned = SimRequest("p", list(range(100, 116)), 1, 4)  # 4 full blocks
    pinned.pin = ("s", 60.0)
    _finish(scheduler, pinned)
    manager = scheduler.kv_cache_manager
    assert (manager.pins.num_pinned_sessions, manager.pins.num_pinned_blocks) == (1, 4)
    assert scheduler.num_free_blocks == 4
    # a request of 3 blocks' prompt that decodes into 6 blocks: it runs out of free blocks mid-decode
    grower = SimRequest("g", list(range(200, 212)), 12, 4)
    _finish(scheduler, grower)
    assert scheduler.counters.num_preemptions == 0
    assert manager.pins.num_pinned_sessions == 0 and manager.pins.num_yields == 1
    assert scheduler.num_free_blocks == 8


def test_pins_expire_at_their_ttl_and_a_session_holds_one_pin():
    scheduler = Scheduler(EngineConfig(num_blocks=16, block_size=4, max_model_len=64))
    first = SimRequest("a1", list(range(100, 108)), 1, 4)
    first.pin = ("s", 10.0)
    _finish(scheduler, first, now=0.0)
    second = SimRequest("a2", list(range(100, 112)), 1, 4)  # the session's next turn: one block more
    second.pin = ("s", 10.0)
    _finish(scheduler, second, now=5.0)
    manager = scheduler.kv_cache_manager
    assert (manager.pins.num_pinned_sessions, manager.pins.num_pinned_blocks) == (1, 3)
    assert [block.ref_cnt for block in manager.find_longest_cache_hit(second.block_hashes, 12)] == [1, 1, 1]
    manager.expire_pins(14.9)  # the first pin's expiry (10.0) passed, but it was replaced
    assert manager.pins.num_pinned_sessions == 1
    manager.expire_pins(15.0)
    assert manager.pins.num_pinned_sessions == 0 and scheduler.num_free_blocks == 16
