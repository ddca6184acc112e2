"""Agents that misbehave, through the whole path under pressure: nothing is lost, hung or leaked.

The real proxy and gate (defaults: `working_set`, pins) before two simulated replicas whose
caches hold about a third of their sessions' contexts, so turns are held, windows lost and
pins yielded. Seeded agents run growing sessions and, now and then:
- give up on a turn at a random moment (at the gate, before the answer's head, or
  mid-stream), or read a stream only to its first chunk and hang up;
- send a turn again while the first is still out (a retry);
- end the session with `x-session-finish`, or silently.

Every answer a client reads to its end is a whole reply or an error in the API's shape.
Afterwards no lease, waiter, attempt, request in flight or engine request is left; the
windows end as their sessions go quiet, each releasing its KV pin at once (not at the pin's
ttl); and once the grace has passed, no session is left either.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.pins import MIN_PIN_TTL_SEC
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import Settings, UpstreamSettings
from kvgate.simulator.replica_server import start_simulated_replicas
from kvgate.simulator.reply_model import FIXED_LENGTHS

KEY = "the-replica-key"
SESSIONS = 24
GRACE_SEC = 2.0
QUIET_FLOOR_SEC = 0.1  # windows end soon after their sessions' last turns ...
RELEASE_SEC = 0.5  # ... and their pins within this, where only a release (not the ttl) ends them
assert RELEASE_SEC + QUIET_FLOOR_SEC * 2 < MIN_PIN_TTL_SEC
# Errors an agent may be answered under pressure: its retry superseded the turn, or it
# waited past gate.max_wait_sec.
EXPECTED_ERRORS = {409: "admission_superseded", 503: "admission_timeout"}
HELD_MS = 20.0  # a wait this long is a hold, not the admission's own time
WORDS = "build test lint grep patch file line error trace diff commit module".split()


@dataclass
class Tally:
    """What the agents saw: answers read whole, by status, and turns they gave up on."""

    statuses: dict[int, int] = field(default_factory=dict)
    gave_up: int = 0
    hung_up: int = 0
    held: int = 0  # answers the gate held back first (`x-kvgate-wait-ms` of HELD_MS or more)

    def saw(self, resp: aiohttp.ClientResponse) -> None:
        self.statuses[resp.status] = self.statuses.get(resp.status, 0) + 1
        self.held += float(resp.headers.get("x-kvgate-wait-ms", "0")) >= HELD_MS


@contextlib.asynccontextmanager
async def pressured_stack():
    """Two replicas of 48 blocks x 16 tokens, steps a few milliseconds long; kvgate before them."""
    replicas = await start_simulated_replicas(
        2,
        time_scale=0.3,
        num_blocks=48,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=768,
        replica_api_key=KEY,
        reply_model=FIXED_LENGTHS,
    )
    settings = Settings(
        replicas=tuple(ReplicaSettings(r.name, r.url) for r in replicas),
        gate=GateSettings(
            idle_grace_sec=GRACE_SEC,
            quiet_floor_sec=QUIET_FLOOR_SEC,
            quiet_factor=2,
            max_wait_sec=3.0,
            wait_poll_sec=0.2,
        ),
        upstream=UpstreamSettings(replica_api_key=KEY),
    )
    app = create_app(settings, health_checks=False)
    try:
        host, port = await app.start("127.0.0.1", 0)
        async with aiohttp.ClientSession(base_url=f"http://{host}:{port}") as http:
            yield app, http, replicas
    finally:
        await app.close()
        for replica in replicas:
            await replica.stop()


def chat_body(messages: list[dict], stream: bool) -> dict:
    return {"model": "kvgate-sim", "messages": messages, "max_tokens": 6, "stream": stream}


async def read_answer(resp: aiohttp.ClientResponse, stream: bool) -> None:
    """Read an answer to its end and check its shape: a whole reply, or an expected error."""
    if resp.status != 200:
        payload = orjson.loads(await resp.read())
        assert payload["error"]["code"] == EXPECTED_ERRORS.get(resp.status), (resp.status, payload)
        return
    if not stream:
        payload = orjson.loads(await resp.read())
        assert payload["choices"][0]["message"]["content"] is not None, payload
        return
    events = [line for line in (await resp.read()).split(b"\n") if line.startswith(b"data: ")]
    assert events and events[-1] == b"data: [DONE]", events[-3:]


async def send(http: aiohttp.ClientSession, session: str, body: dict, finish: bool, tally: Tally) -> None:
    headers = {"x-session-id": session, **({"x-session-finish": "true"} if finish else {})}
    async with http.post("/v1/chat/completions", json=body, headers=headers) as resp:
        await read_answer(resp, body["stream"])
        tally.saw(resp)


async def hang_up_mid_stream(http: aiohttp.ClientSession, session: str, body: dict, tally: Tally) -> None:
    """Read a stream's first chunk, then close the connection."""
    async with http.post("/v1/chat/completions", json=body, headers={"x-session-id": session}) as resp:
        if resp.status == 200:
            await resp.content.readany()
            resp.close()
            tally.hung_up += 1
        else:
            await read_answer(resp, True)
            tally.saw(resp)


async def agent(http: aiohttp.ClientSession, index: int, seed: int, tally: Tally) -> None:
    """One session of 4-7 turns, its history growing by a tool result a turn."""
    rng = random.Random(seed * 1000 + index)
    session = f"agent-{seed}-{index}"
    messages = [{"role": "system", "content": " ".join(rng.choices(WORDS, k=40))}]
    turns = rng.randint(4, 7)
    for number in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(50, 100)))})
        stream = rng.random() < 0.4
        body = chat_body(messages, stream)
        finish = number == turns - 1 and rng.random() < 0.5
        action = rng.random()
        if action < 0.15:  # gives up at a random moment: at the gate, before the head, mid-answer
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(send(http, session, body, finish, tally), rng.uniform(0.0, 0.15))
                continue
            tally.gave_up += 1
        elif action < 0.25 and stream:
            await hang_up_mid_stream(http, session, body, tally)
        elif action < 0.35:  # retries the turn while the first attempt is still out
            first = asyncio.ensure_future(send(http, session, body, finish, tally))
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            await asyncio.gather(first, send(http, session, body, finish, tally))
        else:
            await send(http, session, body, finish, tally)
        messages.append({"role": "assistant", "content": "ok"})
        await asyncio.sleep(rng.uniform(0.0, 0.05))  # the tool call


async def until(condition, what: str, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def stop_replica(replica, after_sec: float | None) -> None:
    """Stop `replica` (its server closes, its turns in flight end first) after `after_sec`."""
    if after_sec is not None:
        await asyncio.sleep(after_sec)
        await replica.stop()


@pytest.mark.parametrize(("seed", "stop_at"), [(0, None), (1, None), (2, 0.5)], ids=["seed0", "seed1", "replica-stops"])
async def test_misbehaving_agents_under_pressure_leave_nothing_behind(seed, stop_at):
    tally = Tally()
    async with pressured_stack() as (app, http, replicas):
        agents = (agent(http, index, seed, tally) for index in range(SESSIONS))
        await asyncio.gather(stop_replica(replicas[1], stop_at), *agents)
        live = replicas if stop_at is None else replicas[:1]
        counts = app.admission.counts

        def settled() -> bool:
            now = counts()
            in_flight = sum(r.in_flight for r in app.registry.all())
            engines = any(r.engine.scheduler.running or r.engine.scheduler.waiting for r in live)
            return (now["leases"], now["waiters"], now["attempts"], in_flight, engines) == (0, 0, 0, 0, False)

        await until(settled, "every lease, waiter, attempt and engine request to end")
        await until(lambda: counts()["windows"] == 0, "every window to end (its session went quiet)")
        # A window's end releases its pin at once, well before the pin's own ttl would end it
        # (MIN_PIN_TTL_SEC at least, from its turn's end).
        pins = [r.engine.scheduler.kv_cache_manager.pins for r in live]
        await until(lambda: all(p.num_pinned_sessions == 0 for p in pins), "ended windows' pins released", RELEASE_SEC)
        await asyncio.sleep(GRACE_SEC + 0.2)
        assert counts() == {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}
    assert tally.statuses.get(200, 0) > SESSIONS * 3, tally
    assert tally.gave_up and tally.hung_up and tally.held, tally  # the chaos and the pressure happened
