"""Agents that misbehave, for the chaos tests (tests/proxy/test_chaos.py against simulated
replicas, tests/vllm_plugin/test_chaos_on_vllm.py against vLLM).

Each agent runs one session of growing turns on one API (chat, Anthropic messages, or
Responses chained by `previous_response_id`) and, as its seeded dice say, gives up on a turn
at a random moment, hangs up a stream after its first chunk, or sends a turn again while the
first is still out. Every answer it reads to its end is checked: a whole reply, or an error
in the API's shape that the `Tally` expects. `kvgate_before` puts a kvgate with the runs'
gate settings (`CHAOS_GATE`) before replicas; `assert_nothing_left` checks, after the
agents, every tier's books and the replicas' engines and pins.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
from dataclasses import dataclass, field

import aiohttp
import orjson

from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.pins import MIN_PIN_TTL_SEC
from kvgate.gate.settings import GateSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.settings import AuthSettings, Settings, UpstreamSettings
from kvgate.wire.replica_auth import REPLICA_KEY_HEADER
from tests.gate.helpers import CLEAN

GRACE_SEC = 0.6  # the gates' idle grace: then no session is left
QUIET_FLOOR_SEC = 0.1  # windows end soon after their sessions' last turns ...
RELEASE_SEC = 0.5  # ... and their pins within this, where only a release (not the ttl) ends them
assert RELEASE_SEC + QUIET_FLOOR_SEC * 2 < MIN_PIN_TTL_SEC
# The gate's defaults but for windows that end soon after their sessions go quiet, and
# waits and polls bounded for a run of seconds.
CHAOS_GATE = {
    "idle_grace_sec": GRACE_SEC,
    "quiet_floor_sec": QUIET_FLOOR_SEC,
    "quiet_factor": 2,
    "max_wait_sec": 3.0,
    "wait_poll_sec": 0.2,
}

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


@dataclass(frozen=True)
class Api:
    """One client API: its route, a turn's body, and what a whole answer looks like."""

    path: str
    stream_end: bytes  # the last event of a whole stream

    def body(self, model: str, system: str, history: list[dict], stream: bool, previous_id: str | None) -> dict:
        if self.path == "/v1/messages":
            return {"model": model, "system": system, "messages": history, "max_tokens": 6, "stream": stream}
        if self.path == "/v1/responses":  # a chain sends only its new input after the previous response
            new = history[-1:] if previous_id else [{"role": "system", "content": system}, *history]
            body = {"model": model, "input": new, "max_output_tokens": 16, "stream": stream}
            return {**body, "previous_response_id": previous_id} if previous_id else body
        messages = [{"role": "system", "content": system}, *history]
        return {"model": model, "messages": messages, "max_tokens": 6, "stream": stream}

    def check(self, payload: dict) -> str | None:
        """Assert `payload` is a whole non-streamed answer; its response id (Responses)."""
        if self.path == "/v1/messages":
            assert payload["type"] == "message" and payload["stop_reason"], payload
        elif self.path == "/v1/responses":
            assert payload["status"] == "completed" or payload["incomplete_details"] == {"reason": "max_output_tokens"}
            return payload["id"]
        else:
            assert payload["choices"][0]["finish_reason"], payload
        return None


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
    client_key: str | None = None  # the kvgate client key it carries (its tenant's)

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
        headers = {"x-session-id": self.session, **({"x-session-finish": "true"} if self.finish else {})}
        return {**headers, "Authorization": f"Bearer {self.client_key}"} if self.client_key else headers


async def act(turn: Turn, rng: random.Random, tally: Tally, retries: bool = True) -> str | None:
    """Send `turn` as the agent's dice say (`retries` False: never twice); the response id of
    an answer read whole, if any."""
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
    if action < 0.35 and retries:  # retries the turn while the first attempt is still out
        first = asyncio.ensure_future(turn.send(tally))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        return (await asyncio.gather(first, turn.send(tally)))[1]
    return await turn.send(tally)


@dataclass(frozen=True)
class Sessions:
    """The agents' sessions: the model they name, and how their histories grow."""

    model: str = "kvgate-sim"
    system_words: int = 40
    result_words: tuple[int, int] = (50, 100)  # a tool result's words, each turn
    turns: tuple[int, int] = (4, 7)
    client_key: str | None = None  # the kvgate client key its turns carry: a tenant's (docs/security.md)
    retries: bool = True  # it sends a turn again while the first attempt is out, now and then


async def agent(http: aiohttp.ClientSession, index: int, seed: int, tally: Tally, sessions: Sessions) -> None:
    """One session on one API, its history growing by a tool result a turn; on the
    Responses API, a chain of previous_response_id while its answers come whole."""
    rng = random.Random(seed * 1000 + index)
    api = (CHAT, MESSAGES, RESPONSES)[index % 3]
    session = f"agent-{seed}-{index}"
    system = " ".join(rng.choices(WORDS, k=sessions.system_words))
    history: list[dict] = []
    previous_id = None
    turns = rng.randint(*sessions.turns)
    for number in range(turns):
        history.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(*sessions.result_words)))})
        body = api.body(sessions.model, system, history, rng.random() < 0.4, previous_id)
        turn = Turn(http, api, session, body, number == turns - 1 and rng.random() < 0.5, sessions.client_key)
        previous_id = await act(turn, rng, tally, sessions.retries)
        history.append({"role": "assistant", "content": "ok"})
        await asyncio.sleep(rng.uniform(0.0, 0.05))  # the tool call


async def until(condition, what: str, seconds: float = 10.0) -> None:
    """Poll `condition` (a function, or a coroutine function) until it holds."""
    for _ in range(max(1, int(seconds / 0.02))):
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def kvgate_before(
    replicas: list[tuple[str, str]],
    replica_key: str | None = None,
    api_key: str | None = None,
    client_keys: tuple[str, ...] = (),
):
    """kvgate (in this process, its books at hand, its gate CHAOS_GATE) before `replicas`
    (name, url), taking `client_keys` (each a tenant) when given; yields the app and a
    client session on it."""
    settings = Settings(
        replicas=tuple(ReplicaSettings(name, url) for name, url in replicas),
        auth=AuthSettings(api_keys=client_keys),
        gate=GateSettings(**CHAOS_GATE),
        upstream=UpstreamSettings(replica_api_key=replica_key, api_key=api_key),
    )
    app = create_app(settings, health_checks=False)
    try:
        host, port = await app.start("127.0.0.1", 0)
        async with aiohttp.ClientSession(base_url=f"http://{host}:{port}") as http:
            yield app, http
    finally:
        await app.close()


async def kv_answer(url: str, headers: dict[str, str]) -> dict:
    """A replica's kv answer (`GET /v1/kvgate/kv`), asked as a gate asks it."""
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/kvgate/kv", headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return orjson.loads(await resp.read())


async def assert_nothing_left(
    apps: list, live: list[str], replica_key: str | None = None, api_key: str | None = None
) -> None:
    """After the agents: no lease, waiter, attempt or request in flight at any kvgate of
    `apps` (one, or every tier's), and no request running or waiting in the `live`
    replicas' engines; the windows end as their sessions go quiet, releasing their pins in
    the engines at once (not at the pins' ttl, at least MIN_PIN_TTL_SEC from their turns'
    ends); after the grace, no session."""
    headers = {REPLICA_KEY_HEADER: replica_key} if replica_key else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def counts() -> dict[str, int]:
        total = dict.fromkeys(CLEAN, 0)
        for app in apps:
            for key, value in app.admission.counts().items():
                total[key] += value
        return total

    def settled() -> bool:
        now, in_flight = counts(), sum(r.in_flight for app in apps for r in app.registry.all())
        return (now["leases"], now["waiters"], now["attempts"], in_flight) == (0, 0, 0, 0)

    async def engines_hold(*fields: str) -> int:
        """The sum of `fields` over the live replicas' kv answers (one answer each)."""
        answers = [await kv_answer(url, headers) for url in live]
        return sum(answer[field] or 0 for answer in answers for field in fields)

    async def engines_idle() -> bool:
        return await engines_hold("num_running", "num_waiting") == 0

    async def unpinned() -> bool:
        return await engines_hold("num_pinned_sessions") == 0

    await until(settled, "every lease, waiter, attempt and request in flight to end")
    await until(engines_idle, "the engines to run and queue nothing")
    await until(lambda: counts()["windows"] == 0, "every window to end (its session went quiet)")
    await until(unpinned, "the ended windows' pins to be released", RELEASE_SEC)
    await asyncio.sleep(GRACE_SEC + 0.2)
    assert counts() == CLEAN
