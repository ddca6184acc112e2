"""The proxy's turn path in-process: route, admit, run on the engine, learn, release.

What `proxy/forward.py` does per turn, minus HTTP, with the proxy's own pieces: the
session keeps the replica it ran on (`proxy.turn_route.pinned_replica`), otherwise the
balancer picks one (the replica whose gate books the fewest sessions, where the gate
enforces and `gate.place_sessions`; else rendezvous); the replica's gate admits
it (`AdmissionController.acquire`, the proxy's own controller with in-process probes);
a replica that left while the turn waited sends it elsewhere once
(`proxy.turn_route.after_failure`), and a held turn moves once to a replica with nothing
to do (`gate/relocation.py`); one `proxy.turn_hold.Hold` keeps the replica's
in-flight count and the lease, given back when the engine finished, unserved when the
replica failed under it; a served turn's usage (its prompt tokens and prefix-cache hit,
what vLLM's answer reports) teaches the gate (`Lease.learn`); a finishing turn ends
the session's windows. A lease with a KV pin (`gate/pins.py`) sends its request with it,
as the proxy puts it in the body. `direct` mode skips the gate and the balancer: session i runs on replica
i mod (replicas), as `kvgate bench agentic`'s direct mode does.

The request body the gate sees (`TurnBody`) has the JSON size of the real turn's
body: the working_set policy bounds a prompt by its body's bytes, and that is all the
gate reads of it besides `max_tokens`; the in-process prefix probe reads the
turn's request from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import orjson

from kvgate.balancer.balancer import Balancer
from kvgate.balancer.registry import Replica, ReplicaRegistry
from kvgate.gate.admission import AdmissionController
from kvgate.gate.errors import AdmissionError, ReplicaUnavailable, SessionRelocated
from kvgate.gate.readings import PrefixReading, UsageReading, prefix_reading, usage_reading
from kvgate.gate.settings import ProbeSettings
from kvgate.gate.usage_cache import UsageCache
from kvgate.proxy.session_tracker import SessionEntry
from kvgate.proxy.turn_hold import UNGATED, Hold, TurnLease
from kvgate.proxy.turn_route import Failure, Resend, after_failure, moved_to, others, pinned_replica
from kvgate.simulator.session_request import SessionRequest
from kvgate.simulator.virtual_engine import EngineStopped, SimEngine
from kvgate.wire.kv_pins import Pin, make_pin
from kvgate.wire.probe_api import KvAnswer

_MESSAGE_BYTES = len(b'{"role":"user","content":""}')


class TurnBody(dict):
    """A chat body of a given JSON size that carries its turn's request for the prefix probe."""

    __slots__ = ("request",)

    def __init__(self, request: SessionRequest, messages: list[dict], max_tokens: int) -> None:
        super().__init__(model="sim", max_tokens=max_tokens, messages=messages)
        self.request = request


class ThreadHistory:
    """One thread's chat history as its turns' bodies carry it: the first message names the
    thread (its sequence id) and each turn appends one message of the bytes its body grew
    by, so a body has its turn's JSON size and continues its thread's history as an
    agent's does (the gate reads only what a turn adds, and tells a session's threads
    apart: `request_body.turn_media`)."""

    def __init__(self, sequence_id: int) -> None:
        self.sequence_id = sequence_id
        self.messages: list[dict] = []
        self._message_bytes = 0  # the JSON of the messages so far, with their commas

    def body(self, turn: int, request: SessionRequest, body_bytes: int, max_tokens: int) -> TurnBody:
        """Turn `turn`'s body (0-based; a re-sent turn's again), `body_bytes` long where its
        growth allows (never shorter than its messages)."""
        if turn == len(self.messages):
            empty = len(orjson.dumps(TurnBody(request, [], max_tokens)))
            room = body_bytes - empty - self._message_bytes - _MESSAGE_BYTES - (1 if self.messages else 0)
            head = f"thread {self.sequence_id} " if not self.messages else ""
            message = {"role": "user", "content": head + _padding(room - len(head))}
            self._message_bytes += len(orjson.dumps(message)) + (1 if self.messages else 0)
            self.messages.append(message)
        assert turn < len(self.messages), f"turn {turn} of a thread with {len(self.messages)} turns so far"
        return TurnBody(request, self.messages[: turn + 1], max_tokens)


def _padding(length: int) -> str:
    return "x" * max(0, length)


class EngineProbe:
    """The gate's probe of one simulated engine: the probe API's answers, in-process, given between
    the engine's steps as vLLM gives them (`SimEngine.between_steps`)."""

    def __init__(
        self, engines: Mapping[str, SimEngine], name: str, settings: ProbeSettings, clock: Callable[[], float]
    ) -> None:
        self._engines = engines
        self._name = name
        self._answer: KvAnswer | None = None  # the engine's last answer and its reading (readings are immutable)
        self._reading: UsageReading | None = None
        self._usage = UsageCache.of(self._read_usage, settings, clock)  # shared and reused, as the proxy's probe

    async def usage(self, newer_than: float | None = None) -> UsageReading | None:
        return await self._usage.usage(newer_than)

    def ready_usage(self) -> UsageReading | None:
        return self._usage.ready()

    def revalidate_usage(self) -> None:
        self._usage.revalidate()

    def close(self) -> None:
        """The gate is going away: cancel a usage refresh still in flight."""
        self._usage.close()

    async def _read_usage(self) -> UsageReading | None:
        """`GET /v1/kvgate/kv`, in-process."""
        engine = self._engines.get(self._name)
        if engine is None or engine.stopped:
            return None
        try:
            answer = await engine.between_steps(engine.kv_answer)
        except EngineStopped:
            return None
        if answer is not self._answer:
            # the server's own field, as the replica's `/v1/kvgate/kv` route adds it to its engines'
            served = replace(answer, scheduling_policy=engine.config.scheduling_policy)
            self._answer, self._reading = answer, usage_reading(served)
        return self._reading

    async def prefix(self, route_kind: str, body: Mapping[str, object]) -> PrefixReading | None:
        engine = self._engines.get(self._name)
        if engine is None or engine.stopped or not isinstance(body, TurnBody):
            return None
        try:
            return prefix_reading(await engine.between_steps(lambda: engine.prefix_answer(body.request)))
        except EngineStopped:
            return None

    def pin(self, session: str, ttl_sec: float) -> Pin:
        """The KV pin a turn goes out with (the simulated replicas keep no replica key)."""
        return make_pin(session, ttl_sec, None)

    async def release_pins(self, sessions: tuple[str, ...]) -> None:
        """`POST /v1/kvgate/release`, in-process."""
        engine = self._engines.get(self._name)
        if engine is not None and not engine.stopped:
            try:
                await engine.between_steps(lambda: engine.release_pins(sessions))
            except EngineStopped:
                pass  # the replica is gone, and its pins with it


@dataclass(slots=True)
class TurnOutcome:
    ok: bool
    status: str  # "ok", an AdmissionError code, "upstream_failed", "no_replica"
    replica: str | None
    admission: str | None
    wait_ms: float
    finished_at: float | None
    first_token_at: float | None
    request: SessionRequest


class FrontDoor:
    """The proxy's turn path over in-process engines (`proxy.turn_route`, `proxy.turn_hold`)."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        engines: dict[str, SimEngine],
        controller: AdmissionController | None,
    ) -> None:
        self.registry = registry
        self.balancer = Balancer(registry)
        self.engines = engines
        self.controller = controller  # None: direct (no proxy)
        # as proxy.forward: a gate that is not off learns each served turn's usage
        self.learns_usage = controller is not None and controller.settings.mode != "off"
        self._sessions: dict[str, SessionEntry] = {}
        # as proxy.forward: where the gates' books count sessions, a new one goes to the fewest
        self._sessions_on = None if controller is None else controller.placement()

    def _route(self, session_id: str, direct_index: int) -> Replica | None:
        if self.controller is None:
            routable = self.registry.routable()
            return routable[direct_index % len(routable)] if routable else None
        return pinned_replica(self._sessions.get(session_id)) or self.balancer.choose(
            session_id, None, self._sessions_on
        )

    async def turn(self, session_id: str, direct_index: int, request: SessionRequest, body: TurnBody, finish: bool):
        """Run one turn; the outcome says how it ended (never raises an AdmissionError)."""
        try:
            return await self._turn(session_id, direct_index, request, body)
        finally:
            if finish and self.controller is not None:
                self.controller.finish_session(session_id)
                self._sessions.pop(session_id, None)

    async def _admit(self, replica: Replica, session_id: str, body: TurnBody) -> tuple[Replica, TurnLease | str]:
        """The replica and lease of an admitted turn, or the replica and the refusal's status.
        A replica that left while the turn waited sends it elsewhere once, as the proxy does."""
        if self.controller is None:
            return replica, UNGATED
        spent: frozenset[Failure] = frozenset()
        moved = False  # as proxy.forward: a held turn moves to a replica with nothing to do at most once
        while True:
            elsewhere = None if moved else (lambda held_on=replica: others(self.registry.routable(), held_on))
            try:
                return replica, await self.controller.acquire(replica, session_id, "chat", body, elsewhere=elsewhere)
            except SessionRelocated as relocated:
                replica, moved = moved_to(self.registry.routable(), relocated.replica, replica), True
            except ReplicaUnavailable:
                after = after_failure(Failure.UNAVAILABLE, spent, tiered=False, in_flight=replica.in_flight)
                other = (
                    self.balancer.choose(session_id, replica, self._sessions_on)
                    if after.resend is Resend.OTHER
                    else None
                )
                if after.resend is Resend.NOWHERE:
                    return replica, "replica_unavailable"
                if other is None:
                    return replica, "no_replica"
                replica, spent = other, spent | {Failure.UNAVAILABLE}
            except AdmissionError as refusal:
                return replica, refusal.code

    async def _turn(self, session_id: str, direct_index: int, request: SessionRequest, body: TurnBody):
        replica = self._route(session_id, direct_index)
        if replica is None:
            return TurnOutcome(False, "no_replica", None, None, 0.0, None, None, request)
        replica, lease = await self._admit(replica, session_id, body)
        if isinstance(lease, str):
            return TurnOutcome(
                False, lease, None if lease == "no_replica" else replica.name, None, 0.0, None, None, request
            )
        pin = getattr(lease, "pin", None)  # the body's kv_transfer_params.kvgate_pin
        if pin is not None:
            request.pin = (pin.session, pin.ttl_sec)
        priority = getattr(lease, "priority", None)  # Admit.priority: as the proxy forwards it
        if priority is not None:
            request.priority = priority
        with Hold(replica, lease) as hold:
            turn = self.engines[replica.name].add(request)
            try:
                finished_at = await turn.done
            except (EngineStopped, ValueError) as failure:
                status = "upstream_failed" if isinstance(failure, EngineStopped) else "prompt_too_long"
                return TurnOutcome(
                    False, status, replica.name, lease.reason or None, lease.wait_ms, None, None, request
                )
            # The replica served the prompt and reports its usage, as vLLM's answer does:
            # the gate learns the turn's exact size and its hit from it.
            if self.learns_usage:
                lease.learn(request.num_prompt_tokens, request.num_cached_prompt_tokens, request.num_output_tokens)
            hold.served = True
        if self.controller is not None:
            entry = self._sessions.get(session_id) or self._sessions.setdefault(session_id, SessionEntry(0.0))
            entry.replica = replica
        return TurnOutcome(
            True, "ok", replica.name, lease.reason or None, lease.wait_ms, finished_at, turn.first_token_at, request
        )

    def forget_replica(self, replica: Replica) -> None:
        """A replica left: sessions pinned to it re-hash on their next turn."""
        for entry in self._sessions.values():
            if entry.replica is replica:
                entry.replica = None
