"""The one scripted sequence every server that keeps KV pins must pass (`wire.kv_pins`).

Run against the vLLM plugin's retention connector (tests/vllm_plugin) and the simulated replica
(tests/simulator), over HTTP, with the same steps and the same assertions: that is what
ties the simulator's pins to the engine's. Prompts are token ids (`/v1/completions`), so
their block counts are exact on both; sizes are read from the replica's kv answer.

The replica must be otherwise idle, have prefix caching on, serve `/v1/completions` with
token-id prompts of up to `num_total_blocks - 1` blocks, and hold no pin at the start.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from kvgate.wire.kv_pins import RELEASE_PATH, Pin, ReleaseAnswer, ReleaseQuery, make_pin, with_pin
from kvgate.wire.probe_api import KV_PATH, PREFIX_PATH, KvAnswer, PrefixAnswer

TOKEN_RANGE = (
    3,
    900,
)  # ids every test vocabulary has (the tiny vLLM model has 980: its BPE training stops short of 1024)


@dataclass
class PinReplica:
    """A replica under test: its URL, served model, the headers a gate sends (client key and
    replica key) and the replica key pins are proved with (None: an open replica API).
    `preemptions`, when given, reads the engine's preemption count. `short_ttl_sec`: the
    ttl of the pin that must end by itself, long enough that the replica still holds it
    when its turn has been answered and its kv read."""

    url: str
    model: str
    headers: dict
    replica_key: str | None
    preemptions: Callable[[], Awaitable[float]] | None = None
    short_ttl_sec: float = 1.0


class _Client:
    def __init__(self, replica: PinReplica, http: aiohttp.ClientSession):
        self.replica, self.http = replica, http

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        async with self.http.request(method, self.replica.url + path, json=body, headers=self.replica.headers) as r:
            doc = await r.json(content_type=None)
            assert r.status == 200, f"{method} {path}: {r.status} {doc}"
            return doc

    async def kv(self) -> KvAnswer:
        return KvAnswer.parse(await self._json("GET", KV_PATH))

    async def prefix_hits(self, prompt: list[int]) -> int:
        return PrefixAnswer.parse(await self._json("POST", PREFIX_PATH, {"token_ids": prompt})).hit_blocks

    async def turn(self, prompt: list[int], pin: Pin | dict | None = None) -> None:
        body: dict = {"model": self.replica.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if isinstance(pin, Pin):
            body = with_pin(body, pin)
        elif pin is not None:
            body["kv_transfer_params"] = {"kvgate_pin": pin}
        await self._json("POST", "/v1/completions", body)

    async def release(self, *sessions: str) -> ReleaseAnswer:
        return ReleaseAnswer.parse(await self._json("POST", RELEASE_PATH, ReleaseQuery(sessions).to_json()))

    def pin(self, session: str, ttl_sec: float = 120.0) -> Pin:
        return make_pin(session, ttl_sec, self.replica.replica_key)


def prompt_of(seed: int, num_blocks: int, block_size: int) -> list[int]:
    """A prompt of exactly `num_blocks` full blocks, distinct for each seed."""
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(num_blocks * block_size)]


async def run_pin_sequence(replica: PinReplica, http: aiohttp.ClientSession) -> None:
    """Every step of the pin semantics, asserting each; leaves the replica with no pin."""
    client = _Client(replica, http)
    kv = await client.kv()
    assert kv.num_pinned_blocks == 0 and kv.num_pinned_sessions == 0, f"pins at the start: {kv}"
    assert kv.num_total_blocks and kv.block_size, f"the kv answer has no block counts: {kv}"
    total, size = kv.num_total_blocks, kv.block_size
    before = await replica.preemptions() if replica.preemptions else None
    await _survives_a_flood(client, total, size)
    await _replaced_then_released(client, total, size)
    await _invalid_pins_are_ignored(client, size)
    await _ttl_expires(client, size)
    await _yields_to_a_request(client, total, size)
    if replica.preemptions:
        assert await replica.preemptions() == before, "a pin caused a preemption"
    kv = await client.kv()
    assert kv.num_pinned_blocks == 0 and kv.num_pinned_sessions == 0, f"pins left at the end: {kv}"


def flood_window(total: int) -> int:
    """The blocks of the window a flood is measured on: an eighth of the cache."""
    return max(2, total // 8)


async def _flood(client: _Client, total: int, size: int, first_seed: int) -> tuple[int, int]:
    """Other sessions' prompts of a quarter of the cache each, through it three times over
    (prompts of seeds from `first_seed`); (blocks per prompt, prompts sent)."""
    flood = max(1, total // 4)
    turns = 3 * -(-total // flood)
    for seed in range(first_seed, first_seed + turns):
        await client.turn(prompt_of(seed, flood, size))
    return flood, turns


async def _survives_a_flood(client: _Client, total: int, size: int) -> None:
    """A pinned window stays resident through a flood that evicts an unpinned one."""
    window = flood_window(total)
    pinned, unpinned = prompt_of(1, window, size), prompt_of(2, window, size)
    await client.turn(pinned, client.pin("a"))
    await client.turn(unpinned)
    kv = await client.kv()
    assert kv.num_pinned_sessions == 1 and kv.num_pinned_blocks >= window, f"after a pinned turn: {kv}"
    assert await client.prefix_hits(pinned) == window
    await _flood(client, total, size, first_seed=100)
    assert await client.prefix_hits(pinned) == window, "the pinned window was evicted by the flood"
    assert await client.prefix_hits(unpinned) < window / 2, "the flood did not evict the unpinned window"


async def measure_flood(client: _Client, total: int, size: int, session: str = "measured") -> dict:
    """The issue's measure of KV pins: the hit ratio of a pinned window (`flood_window`) and
    of an unpinned one after a flood of other sessions' prompts (`_flood`); the pin is
    released at the end. A dict of the sizes and both ratios (and the engine's preemptions
    during it, where the replica reads them), as the results page stores it."""
    window = flood_window(total)
    before = await client.replica.preemptions() if client.replica.preemptions else None
    pinned, unpinned = prompt_of(21, window, size), prompt_of(22, window, size)
    await client.turn(pinned, client.pin(session))
    await client.turn(unpinned)
    flood, turns = await _flood(client, total, size, first_seed=200)  # not the sequence's prompts
    pinned_hits, unpinned_hits = await client.prefix_hits(pinned), await client.prefix_hits(unpinned)
    await client.release(session)
    after = await client.replica.preemptions() if client.replica.preemptions else None
    return {
        "num_total_blocks": total,
        "block_size": size,
        "window_blocks": window,
        "flood_turns": turns,
        "flood_blocks": flood,
        "pinned_hit": pinned_hits / window,
        "unpinned_hit": unpinned_hits / window,
        "preemptions": None if before is None or after is None else round(after - before),
    }


async def _replaced_then_released(client: _Client, total: int, size: int) -> None:
    """A session's next pinned turn replaces its pin; a release frees exactly what it held."""
    window = flood_window(total)  # the flood's pinned window, extended
    longer = prompt_of(1, window, size) + prompt_of(3, 2, size)
    await client.turn(longer, client.pin("a"))
    kv = await client.kv()
    assert kv.num_pinned_sessions == 1, f"a second pinned turn of one session: {kv}"
    assert window + 2 <= (kv.num_pinned_blocks or 0) <= window + 3, f"the pin was not replaced: {kv}"
    answer = await client.release("a")
    assert answer == ReleaseAnswer(1, kv.num_pinned_blocks or 0), answer
    assert await client.release("a", "never-pinned") == ReleaseAnswer(0, 0)
    kv = await client.kv()
    assert kv.num_pinned_blocks == 0 and kv.num_pinned_sessions == 0, f"after the release: {kv}"
    assert await client.prefix_hits(longer) == window + 2, "a release must leave the blocks cached"


async def _invalid_pins_are_ignored(client: _Client, size: int) -> None:
    """A pin without the replica key's proof, or a malformed one, is served unpinned."""
    if client.replica.replica_key:
        await client.turn(prompt_of(4, 2, size), Pin("b", 120.0, "00" * 32))
    await client.turn(prompt_of(5, 2, size), {"session": "c", "ttl_sec": -1})
    kv = await client.kv()
    assert kv.num_pinned_sessions == 0, f"an invalid pin was kept: {kv}"


async def _ttl_expires(client: _Client, size: int) -> None:
    """A pin ends by itself `ttl_sec` after its turn, with no release."""
    ttl = client.replica.short_ttl_sec
    await client.turn(prompt_of(6, 2, size), client.pin("d", ttl_sec=ttl))
    assert (await client.kv()).num_pinned_sessions == 1
    deadline = time.monotonic() + ttl + 0.5  # read until it ends, at most half a second late
    while (kv := await client.kv()).num_pinned_sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert kv.num_pinned_sessions == 0 and kv.num_pinned_blocks == 0, f"the pin outlived its ttl: {kv}"


async def _yields_to_a_request(client: _Client, total: int, size: int) -> None:
    """Pins give their blocks to a request that cannot fit otherwise: it is served, no
    preemption, and the yield is counted."""
    yields = (await client.kv()).num_pin_yields or 0
    await client.turn(prompt_of(7, total // 2, size), client.pin("e"))
    assert (await client.kv()).num_pinned_sessions == 1
    await client.turn(prompt_of(8, total - 1, size))
    kv = await client.kv()
    assert kv.num_pinned_sessions == 0, f"the pin did not yield to a request that needed its blocks: {kv}"
    assert (kv.num_pin_yields or 0) > yields, f"the yield was not counted: {kv}"
