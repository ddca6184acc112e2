"""One policy's run of the cluster simulation, in virtual time.

`run_policy(config, policy)` builds N simulated engines, the balancer's registry, the
proxy's `AdmissionController` (gate settings from the config, the policy's name, probes
into the engines) and the front door, then runs the agents until they are done, on a
`VirtualTimeLoop`. It returns every turn's record, the timeline sampled every
`sample_sec`, and the engines' counters: `report.summarize` turns them into figures.

Agents: with a fixed list of sessions (`sessions`), `concurrency` agents take them in
order, session i not before i x `start_interval_s` (the agentic benchmark's driver);
with `agent_sessions`, `agents` agents each run endless sessions back to back until
`duration_s` (no turn starts after it). A turn that fails because its replica went
away is re-sent after `RETRY_AFTER_SEC`, at most `MAX_ATTEMPTS` times; a turn that
still fails ends its session, as in the benchmark.

Policies: `sticky` (the gate off: sticky routing only), every gate policy by its name,
`priority` (`working_set` on engines that schedule by priority, vLLM's `--scheduling-policy
priority`, the turns it would hold forwarded at `gate.held_priority`, 1 unless set: the
agentic benchmark's `kvgate-priority` mode) and `direct` (no proxy: session i on replica
i mod N). Every other policy's engines schedule as the config's `EngineConfig` says.

Deterministic: no wall clock, no unordered iteration; the same config gives the same run.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvgate.balancer.registry import ReplicaRegistry
from kvgate.bench.cluster.front_door import EngineProbe, FrontDoor, ThreadHistory
from kvgate.bench.cluster.workload import AgentSessions, SessionTokens
from kvgate.gate.admission import AdmissionController
from kvgate.gate.metrics import GateMetrics
from kvgate.gate.policies.registry import POLICIES
from kvgate.gate.settings import GateSettings, ProbeSettings
from kvgate.simulator.config import CostModel, EngineConfig
from kvgate.simulator.session_request import SessionRequest
from kvgate.simulator.virtual_engine import SimEngine
from kvgate.simulator.virtual_loop import run_virtual

RETRY_AFTER_SEC = 1.0
MAX_ATTEMPTS = 3
RETRYABLE = frozenset({"upstream_failed", "replica_unavailable", "no_replica"})
# How a thread of a session ended (`_Cluster._run_thread`).
_COMPLETED, _FAILED, _OUT_OF_TIME = object(), object(), object()


# The policy whose engines schedule by priority, with the gate's held turns sent at low priority.
PRIORITY = "priority"


def policy_names() -> tuple[str, ...]:
    """Every policy a run can compare: sticky, the gate's policies, priority, direct."""
    return ("sticky", *sorted(POLICIES), PRIORITY, "direct")


@dataclass(frozen=True)
class Event:
    """At `at_s`: `remove` replica `arg`, `add` replica `arg`, or set the active `agents` to int(arg)."""

    at_s: float
    kind: str
    arg: str

    def describe(self) -> str:
        return f"{self.kind} {self.arg} at {self.at_s:g}s"


EVENT_KINDS = ("remove", "add", "agents")


def parse_event(text: str) -> Event:
    """`KIND@SECONDS:ARG`: remove@1800:r3, add@2400:r64, agents@600:2048."""
    try:
        head, arg = text.split(":", 1)
        kind, at = head.split("@", 1)
        event = Event(float(at), kind, arg)
    except ValueError:
        raise ValueError(f"event {text!r}: write KIND@SECONDS:ARG, e.g. remove@1800:r3 or agents@600:2048") from None
    if kind not in EVENT_KINDS or event.at_s < 0 or not arg:
        raise ValueError(f"event {text!r}: KIND is one of {', '.join(EVENT_KINDS)} and SECONDS >= 0")
    if kind == "agents" and not arg.isdigit():
        raise ValueError(f"event {text!r}: agents takes a count")
    return event


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int
    engine: EngineConfig
    cost_model: CostModel = CostModel()
    time_scale: float = 1.0
    gate: dict = field(default_factory=dict)  # gate settings (GateSettings field names; probe: {...})
    sessions: tuple[SessionTokens, ...] = ()  # a fixed list of sessions ...
    concurrency: int = 1
    start_interval_s: float = 0.0
    agent_sessions: AgentSessions | None = None  # ... or endless sessions per agent
    agents: int = 0
    duration_s: float = 0.0
    send_finish: bool = True
    events: tuple[Event, ...] = ()
    sample_sec: float = 1.0
    token_scale: float = 1.0  # one simulated token stands for this many real ones (reports undo it)
    jump: bool = True  # jump over stable decode steps (False: step by step, the reference)

    def gate_settings(self, policy: str) -> GateSettings:
        values = dict(self.gate)
        probe = values.pop("probe", None)
        settings = dataclasses.replace(GateSettings(), **values)
        if probe:
            settings = dataclasses.replace(settings, probe=dataclasses.replace(ProbeSettings(), **probe))
        if policy == "sticky":
            return dataclasses.replace(settings, mode="off")
        if policy == PRIORITY:
            held = settings.held_priority or 1
            return dataclasses.replace(settings, mode="enforce", policy="working_set", held_priority=held)
        return dataclasses.replace(settings, mode="enforce", policy=policy)

    def engine_config(self, policy: str) -> EngineConfig:
        """The engines' shape in `policy`'s run: `priority` schedules by priority."""
        if policy == PRIORITY:
            return dataclasses.replace(self.engine, scheduling_policy="priority")
        return self.engine


@dataclass
class TurnRecord:
    session: int  # index in start order
    turn: int  # 1-based
    start_s: float
    end_s: float
    ttft_s: float | None
    ok: bool
    attempts: int
    replica: str | None
    admission: str | None
    wait_ms: float
    prompt_tokens: int
    hit_tokens: int
    ceiling_tokens: int  # prompt tokens an infinite cache would hit
    shared_tokens: int = 0  # the part of those every session of its shared prefix has (one copy serves them all)
    output_tokens: int = 0  # its reply's tokens (simulated replicas reply that long, whatever its cap); 0: failed


def session_turns(turns: Iterable[TurnRecord]) -> list[list[TurnRecord]]:
    """Each session's turn records, in turn order (sessions in the order their first record comes)."""
    by_session: dict[int, list[TurnRecord]] = {}
    for turn in turns:
        by_session.setdefault(turn.session, []).append(turn)
    return [sorted(records, key=lambda t: t.turn) for records in by_session.values()]


def tool_call_s(before: TurnRecord, turn: TurnRecord) -> float:
    """The tool call between a session's turn `before` and its next `turn`: the client's own time,
    whatever the policy (a turn starts when its client sends it, before any gate wait)."""
    return max(0.0, turn.start_s - before.end_s)


@dataclass
class SessionRecord:
    index: int
    agent: int  # the agent that ran it (with fixed sessions: the session's own index)
    start_s: float
    end_s: float
    completed: bool


@dataclass
class RunResult:
    policy: str
    turns: list[TurnRecord]
    sessions: list[SessionRecord]
    failed_attempts: dict[str, int]
    timeline: list[dict]
    engines: dict[str, SimEngine]  # every engine the run had, removed ones included
    replica_turns: dict[str, int]
    events: list[tuple[float, str]]
    end_s: float
    token_scale: float = 1.0
    relocated_turns: int = 0  # held turns moved to a replica with nothing to do (gate.relocate_held)
    gate_counts: dict[str, dict[str, int]] = field(default_factory=dict)  # `gate_counts`


class _Cluster:
    def __init__(self, config: ClusterConfig, policy: str) -> None:
        self.config = config
        self.policy = policy
        self.loop = asyncio.get_running_loop()
        self.engines: dict[str, SimEngine] = {}
        self.all_engines: dict[str, SimEngine] = {}
        self.registry = ReplicaRegistry()
        self.metrics = GateMetrics(CollectorRegistry())
        controller = None
        if policy != "direct":
            settings = config.gate_settings(policy)
            controller = AdmissionController(
                settings,
                self.metrics,
                clock=self.loop.time,
                probe_factory=lambda name, url: EngineProbe(self.engines, name, settings.probe, self.loop.time),
            )
        self.controller = controller
        self.front = FrontDoor(self.registry, self.engines, controller)
        self.turns: list[TurnRecord] = []
        self.sessions: list[SessionRecord] = []
        self.failed: dict[str, int] = {}
        self.replica_turns: dict[str, int] = {}
        for index in range(config.replicas):
            self.add_replica(f"r{index}")
        self.events: list[tuple[float, str]] = []
        self.active_agents = config.agents
        self.agents_changed = asyncio.Event()
        self.prefixes_seen: set[int] = set()
        self.session_count = 0

    def add_replica(self, name: str) -> None:
        shape = self.config.engine_config(self.policy)
        engine = SimEngine(name, shape, self.config.cost_model, self.config.time_scale, self.config.jump)
        self.engines[name] = self.all_engines[name] = engine
        self.registry.add(name, f"http://{name}.sim:8000")
        self.replica_turns.setdefault(name, 0)

    def remove_replica(self, name: str) -> None:
        replica = self.registry.remove(name)
        if self.controller is not None:
            self.controller.remove_replica(name)
        self.front.forget_replica(replica)
        self.engines.pop(name).stop()

    # ------------------------------------------------------------------ agents

    async def run_session(self, session: SessionTokens, direct_index: int) -> bool:
        """Run `session`'s turns; False when the traffic ended before the session did (the agent stops)."""
        index = self.session_count
        self.session_count += 1
        started = self.loop.time()
        record = SessionRecord(index, direct_index, started, started, False)
        self.sessions.append(record)
        prefix_id, _ = session.shared_prefix
        prefix_seen = prefix_id in self.prefixes_seen
        self.prefixes_seen.add(prefix_id)
        outcome = await self._run_thread(session, record, direct_index, prefix_seen, [0], main=True)
        if outcome is not _COMPLETED:
            return outcome is not _OUT_OF_TIME
        record.completed = True
        return True

    async def _run_thread(
        self,
        thread: SessionTokens,
        record: SessionRecord,
        direct_index: int,
        prefix_seen: bool,
        turns_run: list[int],
        main: bool = False,
    ) -> object:
        """Run one thread of a session (its main thread, or a subagent's that a tool call of
        it runs, under the same session id): _COMPLETED, _FAILED (a turn failed: the session
        ends) or _OUT_OF_TIME. `turns_run` counts the session's turns across its threads;
        only the main thread's last turn may carry the session's finish."""
        config = self.config
        size = config.engine.block_size
        _, prefix_tokens = thread.shared_prefix
        history = ThreadHistory(thread.sequence_id)
        for k in range(thread.turns):
            if config.agent_sessions is not None and self.loop.time() >= config.duration_s:
                return _OUT_OF_TIME
            prompt = thread.prompts[k]
            reply = thread.replies[k]
            if k == 0:
                ceiling = min(prefix_tokens // size if prefix_seen else 0, (prompt - 1) // size) * size
            else:
                computed = thread.prompts[k - 1] + thread.replies[k - 1] - 1  # the last turn's KV
                ceiling = min(computed // size, (prompt - 1) // size) * size
            shared = min(prefix_tokens // size * size, ceiling)
            last = k == thread.turns - 1
            subagent = thread.subagent_after(k + 1)
            turns_run[0] += 1
            finish = last and main and config.send_finish
            start = self.loop.time()
            outcome = None
            for attempt in range(1, MAX_ATTEMPTS + 1):
                request = SessionRequest(
                    f"{thread.session_id}-{'' if main else f'{thread.sequence_id}-'}{k + 1}-{attempt}",
                    thread.sequence_id,
                    prompt,
                    reply,
                    size,
                    thread.shared_prefix,
                )
                body = history.body(k, request, thread.body_bytes[k], max(reply, thread.max_tokens or 0))
                outcome = await self.front.turn(thread.session_id, direct_index, request, body, finish)
                if outcome.ok or outcome.status not in RETRYABLE or attempt == MAX_ATTEMPTS:
                    break
                self.failed[outcome.status] = self.failed.get(outcome.status, 0) + 1
                await asyncio.sleep(RETRY_AFTER_SEC)
            assert outcome is not None
            end = outcome.finished_at if outcome.ok and outcome.finished_at is not None else self.loop.time()
            if not outcome.ok:
                self.failed[outcome.status] = self.failed.get(outcome.status, 0) + 1
            elif outcome.replica is not None:
                self.replica_turns[outcome.replica] = self.replica_turns.get(outcome.replica, 0) + 1
            request = outcome.request
            self.turns.append(
                TurnRecord(
                    record.index,
                    turns_run[0],
                    start,
                    end,
                    None if outcome.first_token_at is None else outcome.first_token_at - start,
                    outcome.ok,
                    attempt,
                    outcome.replica,
                    outcome.admission,
                    outcome.wait_ms,
                    prompt,
                    request.num_cached_prompt_tokens if outcome.ok else 0,
                    ceiling,
                    shared,
                    reply if outcome.ok else 0,
                )
            )
            record.end_s = end
            if not outcome.ok:
                return _FAILED  # a failed turn ends its session, not its agent
            if subagent is not None:  # the tool call runs a subagent: its thread's turns, then this one goes on
                ran = await self._run_thread(subagent, record, direct_index, True, turns_run)
                if ran is not _COMPLETED:
                    return ran
            if thread.tool_latency_s[k] > 0 and not last:
                if (
                    config.agent_sessions is not None
                    and self.loop.time() + thread.tool_latency_s[k] >= config.duration_s
                ):
                    return _OUT_OF_TIME  # the next turn would start after the traffic ends
                await asyncio.sleep(thread.tool_latency_s[k])
        return _COMPLETED

    async def fixed_sessions(self) -> None:
        config = self.config
        queue = list(config.sessions)
        queue.reverse()

        async def worker() -> None:
            while queue:
                session = queue.pop()
                not_before = session.sequence_id * config.start_interval_s
                if not_before > self.loop.time():
                    await asyncio.sleep(not_before - self.loop.time())
                await self.run_session(session, session.sequence_id)

        await asyncio.gather(*(worker() for _ in range(min(config.concurrency, len(config.sessions)))))

    async def endless_agents(self) -> None:
        config = self.config
        source = config.agent_sessions
        assert source is not None
        most = max([config.agents, *(int(e.arg) for e in config.events if e.kind == "agents")])

        async def agent(number: int) -> None:
            session_number = 0
            while self.loop.time() < config.duration_s:
                if number >= self.active_agents:  # not active now: wait for a load step (or the end)
                    await self._wait_agents_change()
                    continue
                if not await self.run_session(source.session(number, session_number), number):
                    return
                session_number += 1

        await asyncio.gather(*(agent(number) for number in range(most)))

    def set_agents(self, count: int) -> None:
        self.active_agents = count
        changed, self.agents_changed = self.agents_changed, asyncio.Event()
        changed.set()

    async def _wait_agents_change(self) -> None:
        remaining = self.config.duration_s - self.loop.time()
        if remaining <= 0:
            return
        try:
            async with asyncio.timeout(remaining):
                await self.agents_changed.wait()
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ events

    async def play_events(self) -> None:
        for event in sorted(self.config.events, key=lambda e: e.at_s):
            if event.at_s > self.loop.time():
                await asyncio.sleep(event.at_s - self.loop.time())
            if event.kind == "remove":
                self.remove_replica(event.arg)
            elif event.kind == "add":
                self.add_replica(event.arg)
            else:
                self.set_agents(int(event.arg))
            self.events.append((self.loop.time(), event.describe()))

    # ----------------------------------------------------------------- timeline

    def sample(self) -> dict:
        engines = list(self.engines.values())
        usage, running, waiting = [], 0, 0
        for engine in engines:
            engine.settle()
            scheduler = engine.scheduler
            usage.append(scheduler.kv_cache_manager.block_pool.get_usage())
            running += len(scheduler.running)
            waiting += len(scheduler.waiting)
        queries = hits = cpu_hits = evictions = generated = 0
        for engine in self.all_engines.values():
            stats = engine.scheduler.kv_cache_manager.prefix_cache_stats
            queries += stats.queries
            hits += stats.hits
            cpu_hits += stats.cpu_hits
            evictions += engine.scheduler.kv_cache_manager.block_pool.num_evictions
            generated += engine.scheduler.counters.num_generation_tokens
        waiters = 0
        if self.controller is not None:
            for family in self.metrics.waiters.collect():
                waiters += int(sum(sample.value for sample in family.samples))
        return {
            "t": self.loop.time(),
            "kv_usage_mean": sum(usage) / len(usage) if usage else 0.0,
            "kv_usage_max": max(usage) if usage else 0.0,
            "running": running,
            "engine_waiting": waiting,
            "gate_waiters": waiters,
            "queries": queries,
            "hits": hits,
            "cpu_hits": cpu_hits,
            "evictions": evictions,
            "generated": generated,
            "turns_done": len(self.turns),
            "replicas": len(engines),
        }

    async def sampler(self, into: list[dict]) -> None:
        while True:
            into.append(self.sample())
            await asyncio.sleep(self.config.sample_sec)


async def _run(config: ClusterConfig, policy: str) -> RunResult:
    cluster = _Cluster(config, policy)
    timeline: list[dict] = []
    sampler = asyncio.ensure_future(cluster.sampler(timeline))
    events = asyncio.ensure_future(cluster.play_events())
    try:
        if config.agent_sessions is not None:
            await cluster.endless_agents()
        else:
            await cluster.fixed_sessions()
    finally:
        for task in (sampler, events):
            task.cancel()
        await asyncio.gather(sampler, events, return_exceptions=True)
    end = max((t.end_s for t in cluster.turns), default=0.0)
    timeline.append(cluster.sample())
    relocated, counts = 0, {}
    if cluster.controller is not None:
        relocated = sum(counted(cluster.controller, "kvgate_relocated_turns", "replica").values())
        counts = gate_counts(cluster.controller)
        await cluster.controller.aclose()
    for engine in list(cluster.engines.values()):
        engine.stop()
    return RunResult(
        policy,
        cluster.turns,
        cluster.sessions,
        dict(sorted(cluster.failed.items())),
        timeline,
        cluster.all_engines,
        cluster.replica_turns,
        cluster.events,
        end,
        config.token_scale,
        relocated,
        counts,
    )


# The gates' counters the report sums over replicas, by their one other label.
_GATE_COUNTERS = {"held_turns": ("kvgate_held_turns", "outcome"), "window_ends": ("kvgate_window_ends", "cause")}


def counted(controller: AdmissionController, name: str, label: str) -> dict[str, int]:
    """The gates' counter `name` (its `_total` samples), summed by its `label`, sorted."""
    sums: dict[str, int] = {}
    for metric in controller.metrics.registry.collect():
        if metric.name == name:
            for sample in metric.samples:
                if sample.name == f"{name}_total":
                    sums[sample.labels[label]] = sums.get(sample.labels[label], 0) + round(sample.value)
    return dict(sorted(sums.items()))


def gate_counts(controller: AdmissionController) -> dict[str, dict[str, int]]:
    """What the gates counted, summed over their replicas: held newcomers by whether waiting
    gave them a window (`kvgate_held_turns_total`), and windows ended by cause
    (`kvgate_window_ends_total`)."""
    return {key: counted(controller, name, label) for key, (name, label) in _GATE_COUNTERS.items()}


def run_policy(config: ClusterConfig, policy: str) -> RunResult:
    """Run `policy` on `config` in virtual time (see the module docstring)."""
    if policy not in policy_names():
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(policy_names())}")
    return run_virtual(_run(config, policy))
