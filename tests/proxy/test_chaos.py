"""Agents that misbehave, through the whole path under pressure: nothing is lost, hung or leaked.

The real proxy and gate (`working_set`, pins) before two simulated replicas whose caches
hold a few of the sessions' contexts at a time, so turns are held, windows lost and pins
yielded. Seeded agents run growing sessions on the chat, Anthropic messages and Responses
APIs (a Responses session chained by `previous_response_id`) and, now and then:
- give up on a turn at a random moment (at the gate, before the answer's head, or
  mid-stream), or read a stream only to its first chunk and hang up;
- send a turn again while the first is still out (a retry);
- end the session with `x-session-finish`, or silently.
In one case a replica stops mid-run; in another, replicas in processes of their own, one
is killed: a stream it was answering ends with kvgate's error event in the API's shape
(`upstream_stream_broken`), never with a connection cut short.

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
from kvgate.bench.processes import ReplicaShape, ServerGroup
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
# Errors an agent may be answered under pressure (their status and `error.code`): its retry
# superseded the turn, or it waited past gate.max_wait_sec ...
EXPECTED_ERRORS = {409: "admission_superseded", 503: "admission_timeout"}
# ... and where a replica stops or crashes: a turn it had taken, not answered, is not re-sent (only
# one that never reached a replica is: docs/proxy.md), and a Responses chain whose
# previous response lived there is the other replica's 404.
STOPPED_ERRORS = {**EXPECTED_ERRORS, 502: "upstream_failed", 404: 404}
HELD_MS = 20.0  # a wait this long is a hold, not the admission's own time
WORDS = "build test lint grep patch file line error trace diff commit module".split()


@dataclass
class Tally:
    """What the agents saw: answers read whole, by status, and turns they gave up on."""

    expected_errors: dict[int, object]
    crash: bool = False  # a replica crashes: streams it was answering end in an error event
    statuses: dict[int, int] = field(default_factory=dict)
    broken: int = 0  # streams the crash broke off, ended by kvgate's error event
    gave_up: int = 0
    hung_up: int = 0
    held: int = 0  # answers the gate held back first (`x-kvgate-wait-ms` of HELD_MS or more)

    def saw(self, resp: aiohttp.ClientResponse) -> None:
        self.statuses[resp.status] = self.statuses.get(resp.status, 0) + 1
        self.held += float(resp.headers.get("x-kvgate-wait-ms", "0")) >= HELD_MS


# Replicas whose caches hold a few sessions' contexts at a time, steps a few milliseconds long.
SHAPE = {
    "num_blocks": 48,
    "block_size": 16,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "max_model_len": 768,
    "time_scale": 0.3,
}


@contextlib.asynccontextmanager
async def kvgate_before(replicas: list[tuple[str, str]], replica_key: str | None):
    """kvgate (in this process, its books at hand) before `replicas` (name, url)."""
    settings = Settings(
        replicas=tuple(ReplicaSettings(name, url) for name, url in replicas),
        gate=GateSettings(
            idle_grace_sec=GRACE_SEC,
            quiet_floor_sec=QUIET_FLOOR_SEC,
            quiet_factor=2,
            max_wait_sec=3.0,
            wait_poll_sec=0.2,
        ),
        upstream=UpstreamSettings(replica_api_key=replica_key),
    )
    app = create_app(settings, health_checks=False)
    try:
        host, port = await app.start("127.0.0.1", 0)
        async with aiohttp.ClientSession(base_url=f"http://{host}:{port}") as http:
            yield app, http
    finally:
        await app.close()


@contextlib.asynccontextmanager
async def pressured_stack():
    """Two simulated replicas of SHAPE in this process (their engines at hand), kvgate before them."""
    replicas = await start_simulated_replicas(2, **SHAPE, replica_api_key=KEY, reply_model=FIXED_LENGTHS)
    try:
        async with kvgate_before([(r.name, r.url) for r in replicas], KEY) as (app, http):
            yield app, http, replicas
    finally:
        for replica in replicas:
            await replica.stop()


@dataclass(frozen=True)
class Api:
    """One client API: its route, a turn's body, and what a whole answer looks like."""

    path: str
    stream_end: bytes  # the last event of a whole stream

    def body(self, system: str, history: list[dict], stream: bool, previous_id: str | None) -> dict:
        if self.path == "/v1/messages":
            return {"model": MODEL, "system": system, "messages": history, "max_tokens": 6, "stream": stream}
        if self.path == "/v1/responses":  # a chain sends only its new input after the previous response
            new = history[-1:] if previous_id else [{"role": "system", "content": system}, *history]
            body = {"model": MODEL, "input": new, "max_output_tokens": 16, "stream": stream}
            return {**body, "previous_response_id": previous_id} if previous_id else body
        messages = [{"role": "system", "content": system}, *history]
        return {"model": MODEL, "messages": messages, "max_tokens": 6, "stream": stream}

    def check(self, payload: dict) -> str | None:
        """Assert `payload` is a whole non-streamed answer; its response id (Responses)."""
        if self.path == "/v1/messages":
            assert payload["type"] == "message" and payload["stop_reason"], payload
        elif self.path == "/v1/responses":
            # the replicas reply exactly the cap: a whole answer stops at max_output_tokens
            assert (payload["status"], payload["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
            return payload["id"]
        else:
            assert payload["choices"][0]["finish_reason"], payload
        return None


MODEL = "kvgate-sim"
CHAT = Api("/v1/chat/completions", b"data: [DONE]")
MESSAGES = Api("/v1/messages", b"event: message_stop")
RESPONSES = Api("/v1/responses", b"event: response.completed")


async def read_answer(resp: aiohttp.ClientResponse, api: Api, stream: bool, tally: Tally) -> str | None:
    """Read an answer to its end and check its shape: a whole reply (its response id, for a
    Responses turn read whole), or an expected error in the API's shape."""
    raw = await resp.read()
    tally.saw(resp)
    if resp.status != 200:
        assert orjson.loads(raw)["error"]["code"] == tally.expected_errors.get(resp.status), (resp.status, raw)
        return None
    if not stream:
        return api.check(orjson.loads(raw))
    events = [line for line in raw.split(b"\n") if line.startswith((b"data: ", b"event: "))]
    if tally.crash and b'"code":"upstream_stream_broken"' in events[-1]:  # the API's error event, then the end
        tally.broken += 1
        return None
    assert api.stream_end in events[-2:], (api.path, events[-3:])
    return None


@dataclass
class Turn:
    http: aiohttp.ClientSession
    api: Api
    session: str
    body: dict
    finish: bool

    async def send(self, tally: Tally) -> str | None:
        """Send the turn and read its answer whole; the answer's response id, if any."""
        async with self.http.post(self.api.path, json=self.body, headers=self._headers()) as resp:
            return await read_answer(resp, self.api, self.body["stream"], tally)

    async def hang_up(self, tally: Tally) -> None:
        """Read a stream's first chunk, then close the connection."""
        async with self.http.post(self.api.path, json=self.body, headers=self._headers()) as resp:
            if resp.status != 200:
                await read_answer(resp, self.api, True, tally)
                return
            await resp.content.readany()
            resp.close()
            tally.hung_up += 1

    def _headers(self) -> dict[str, str]:
        return {"x-session-id": self.session, **({"x-session-finish": "true"} if self.finish else {})}


async def act(turn: Turn, rng: random.Random, tally: Tally) -> str | None:
    """Send `turn` as the agent's dice say; the response id of an answer read whole, if any."""
    action = rng.random()
    if action < 0.15:  # gives up at a random moment: at the gate, before the head, mid-answer
        try:
            return await asyncio.wait_for(turn.send(tally), rng.uniform(0.0, 0.15))
        except TimeoutError:
            tally.gave_up += 1
            return None
    if action < 0.25 and turn.body["stream"]:
        await turn.hang_up(tally)
        return None
    if action < 0.35:  # retries the turn while the first attempt is still out
        first = asyncio.ensure_future(turn.send(tally))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        return (await asyncio.gather(first, turn.send(tally)))[1]
    return await turn.send(tally)


async def agent(http: aiohttp.ClientSession, index: int, seed: int, tally: Tally) -> None:
    """One session of 4-7 turns on one API, its history growing by a tool result a turn;
    on the Responses API, a chain of previous_response_id while its answers come whole."""
    rng = random.Random(seed * 1000 + index)
    api = (CHAT, MESSAGES, RESPONSES)[index % 3]
    session = f"agent-{seed}-{index}"
    system = " ".join(rng.choices(WORDS, k=40))
    history: list[dict] = []
    previous_id = None
    turns = rng.randint(4, 7)
    for number in range(turns):
        history.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(50, 100)))})
        body = api.body(system, history, rng.random() < 0.4, previous_id)
        previous_id = await act(Turn(http, api, session, body, number == turns - 1 and rng.random() < 0.5), rng, tally)
        history.append({"role": "assistant", "content": "ok"})
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
    tally = Tally(EXPECTED_ERRORS if stop_at is None else STOPPED_ERRORS)
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


async def kv_answer(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/v1/kvgate/kv") as resp:
        return orjson.loads(await resp.read())


async def test_a_replica_that_crashes_mid_run_leaves_nothing_behind(tmp_path):
    """Replicas in processes of their own, one SIGKILLed mid-run: its answers in flight are cut
    short or answered 502, its sessions move, and nothing is left behind on either side."""
    tally = Tally(STOPPED_ERRORS, crash=True)
    async with ServerGroup(tmp_path) as group:
        shape = ReplicaShape(**SHAPE)
        replicas = [(name, await group.start_replica(name, shape)) for name in ("r0", "r1")]
        async with kvgate_before(replicas, None) as (app, http):

            async def crash() -> None:
                await asyncio.sleep(0.5)
                group.kill("r1")

            await asyncio.gather(crash(), *(agent(http, index, 3, tally) for index in range(SESSIONS)))
            counts = app.admission.counts

            def settled() -> bool:
                now = counts()
                in_flight = sum(r.in_flight for r in app.registry.all())
                return (now["leases"], now["waiters"], now["attempts"], in_flight) == (0, 0, 0, 0)

            await until(settled, "every lease, waiter, attempt and request in flight to end")
            live = replicas[0][1]
            engine = await kv_answer(http, live)
            assert (engine["num_running"], engine["num_waiting"]) == (0, 0), engine
            await until(lambda: counts()["windows"] == 0, "every window to end (its session went quiet)")
            for _ in range(int(RELEASE_SEC / 0.05)):
                if (await kv_answer(http, live))["num_pinned_sessions"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await kv_answer(http, live))["num_pinned_sessions"] == 0
            await asyncio.sleep(GRACE_SEC + 0.2)
            assert counts() == {"leases": 0, "windows": 0, "waiters": 0, "attempts": 0, "sessions": 0}
    assert tally.statuses.get(200, 0) > SESSIONS * 3, tally
