"""The agentic workload: sessions of many turns whose prompt grows every turn.

A session is a system prompt, a task, and then turns. Turn k sends the whole history
(system, task, and for every earlier turn j the assistant reply j followed by tool
result j) and receives reply k. Between turn k and k+1 the agent "runs a tool" for
`tool_latency_s` seconds and appends its result. So prompt k+1 starts with prompt k
plus reply k: exactly what a prefix cache can reuse.

Invariants:
- `generate_workload(spec, seed)` is a pure function: the same spec and seed give an
  identical `Workload`. Three `random.Random` streams, each consumed in a fixed order:
  content (prompts, turn counts), tool latencies, retries. So changing only the
  latency or retry settings keeps every session's text and turn count: the heavy-tail
  and retry-storm regimes run the very sessions of the thrash regime.
- Text is made of "token-ish" words: short lowercase words joined by single spaces,
  so one word is about one token for any simple tokenizer. Lengths in the spec are in
  these words.
- Tool results are unique per session (random words), so sessions share nothing but
  the system prompt when `shared_system_prompt` is set.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields, replace

from kvgate.simulator.agent_trace import AgentTrace

# Consonant-vowel syllables give pronounceable words that simple tokenizers keep whole.
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of an agentic workload. Lengths are in words (about one token each)."""

    sessions: int = 16  # sessions in the whole run
    concurrency: int = 8  # active sessions at once (a rolling rollout step)
    start_interval_s: float = 0.0  # session i starts no earlier than i * start_interval_s
    turns_min: int = 6
    turns_max: int = 10
    system_prompt_words: int = 200
    shared_system_prompt: bool = True  # one system prompt for all sessions, or one each
    task_words: int = 100
    tool_result_words_min: int = 100
    tool_result_words_max: int = 300
    reply_tokens: int = 16  # the replica's reply length: every turn's max_tokens, unless max_tokens is set
    # The max_tokens every turn sends, as agent clients send a cap far above their replies
    # (None: each turn's reply length); the replies stay `reply_tokens` long.
    max_tokens: int | None = None
    # Stop strings every capped turn sends (with `max_tokens`): where a real model whose
    # text would not end by itself (random weights) ends its reply, just after vLLM's
    # min_tokens; its turns' texts are then sampled (`apis.turn_request`).
    stop: tuple[str, ...] = ()
    tool_latency_median_s: float = 0.2  # lognormal body of the tool-latency distribution
    tool_latency_sigma: float = 0.5
    tool_tail_prob: float = 0.0  # share of tool calls in the heavy tail
    tool_tail_s: float = 0.0  # tail calls take tool_tail_s * uniform(1, 2)
    retry_prob: float = 0.0  # share of turns re-sent before their answer came back
    retry_after_s_min: float = 0.005
    retry_after_s_max: float = 0.05
    send_finish: bool = True  # the last turn carries x-session-finish (False: sessions end silently)
    # The share of a session's tool calls that run a subagent: a thread of its own under the
    # session's id (its own system prompt, task and tool results, `subagent_turns` turns),
    # whose run is the tool call's time; the session's main thread waits for it, then goes on.
    subagent_prob: float = 0.0
    subagent_turns: int = 3

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot describe a workload."""
        checks = [
            ("sessions", self.sessions >= 1),
            ("concurrency", self.concurrency >= 1),
            ("start_interval_s", self.start_interval_s >= 0),
            ("turns_min", self.turns_min >= 1),
            ("turns_max", self.turns_max >= self.turns_min),
            ("system_prompt_words", self.system_prompt_words >= 0),
            ("task_words", self.task_words >= 1),
            ("tool_result_words_min", self.tool_result_words_min >= 1),
            ("tool_result_words_max", self.tool_result_words_max >= self.tool_result_words_min),
            ("reply_tokens", self.reply_tokens >= 1),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= self.reply_tokens),
            ("stop", not self.stop or (self.max_tokens is not None and all(self.stop))),
            ("tool_latency_median_s", self.tool_latency_median_s >= 0),
            ("tool_latency_sigma", self.tool_latency_sigma >= 0),
            ("tool_tail_prob", 0 <= self.tool_tail_prob <= 1),
            ("tool_tail_s", self.tool_tail_s >= 0),
            ("retry_prob", 0 <= self.retry_prob <= 1),
            ("retry_after_s_min", self.retry_after_s_min >= 0),
            ("retry_after_s_max", self.retry_after_s_max >= self.retry_after_s_min),
            ("subagent_prob", 0 <= self.subagent_prob <= 1),
            ("subagent_turns", self.subagent_turns >= 1),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"workload: {name}={getattr(self, name)!r} is out of range")

    def replace(self, **changes) -> WorkloadSpec:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"workload: unknown field(s) {unknown}; known: {sorted(known)}")
        return WorkloadSpec(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


@dataclass(frozen=True)
class TurnPlan:
    """One turn. `tool_result` is appended after this turn's reply (None on the last turn)."""

    index: int  # 1-based turn index in the session
    tool_result: str | None
    tool_latency_s: float  # time between this turn's reply and the next turn
    retry_after_s: float | None  # re-send the turn after this delay if it has not answered
    reply_tokens: int | None = None  # this turn's max_tokens (None: the spec's reply_tokens)


@dataclass(frozen=True)
class SessionPlan:
    """One session's main thread; `subagents`: (turn index, 1-based: the subagent thread
    the tool call after that turn runs), under the same session id."""

    session_id: str
    index: int
    system_prompt: str
    task: str
    turns: tuple[TurnPlan, ...]
    subagents: tuple[tuple[int, SessionPlan], ...] = ()

    @property
    def threads(self) -> tuple[SessionPlan, ...]:
        """Its main thread (itself), then its subagents' threads."""
        return (self, *(plan for _, plan in self.subagents))

    def subagent_after(self, turn_index: int) -> SessionPlan | None:
        """The subagent thread the tool call after turn `turn_index` runs, if it runs one."""
        return next((plan for after, plan in self.subagents if after == turn_index), None)


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    seed: int
    sessions: tuple[SessionPlan, ...] = field(default_factory=tuple)

    @property
    def threads(self) -> tuple[SessionPlan, ...]:
        """Every thread of every session: each session's main thread, then its subagents'."""
        return tuple(thread for session in self.sessions for thread in session.threads)

    @property
    def num_turns(self) -> int:
        return sum(len(thread.turns) for thread in self.threads)

    def reply_tokens(self, turn: TurnPlan) -> int:
        """The max_tokens of `turn` (the replicas honour it as the reply length)."""
        return self.spec.reply_tokens if turn.reply_tokens is None else turn.reply_tokens


def random_words(rng: random.Random, count: int) -> str:
    """`count` token-ish words, space separated."""
    words = []
    for _ in range(count):
        syllables = rng.randint(1, 3)
        words.append("".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)))
    return " ".join(words)


def sample_tool_latency(rng: random.Random, spec: WorkloadSpec) -> float:
    """Lognormal body around the median, and with `tool_tail_prob` a heavy-tail call."""
    if spec.tool_tail_prob > 0 and rng.random() < spec.tool_tail_prob:
        return spec.tool_tail_s * rng.uniform(1.0, 2.0)
    if spec.tool_latency_median_s == 0:
        return 0.0
    return spec.tool_latency_median_s * math.exp(rng.gauss(0.0, spec.tool_latency_sigma))


def generate_workload(spec: WorkloadSpec, seed: int) -> Workload:
    """The deterministic workload of `spec` for `seed` (see the module invariants)."""
    spec.validate()
    rng = random.Random(seed)
    latency_rng = random.Random(f"{seed}:tool-latency")
    retry_rng = random.Random(f"{seed}:retries")
    shared_system = "You are agent. " + random_words(rng, spec.system_prompt_words)
    sessions = []
    for index in range(spec.sessions):
        system = (
            shared_system
            if spec.shared_system_prompt
            else (f"You are agent {index}. " + random_words(rng, spec.system_prompt_words))
        )
        task = f"Task {index}: " + random_words(rng, spec.task_words)
        num_turns = rng.randint(spec.turns_min, spec.turns_max)
        turns = []
        for turn_index in range(1, num_turns + 1):
            last = turn_index == num_turns
            tool_result = (
                None if last else random_words(rng, rng.randint(spec.tool_result_words_min, spec.tool_result_words_max))
            )
            latency = 0.0 if last else sample_tool_latency(latency_rng, spec)
            retry_after = None
            if spec.retry_prob > 0 and retry_rng.random() < spec.retry_prob:
                retry_after = retry_rng.uniform(spec.retry_after_s_min, spec.retry_after_s_max)
            turns.append(TurnPlan(turn_index, tool_result, latency, retry_after))
        session = SessionPlan(f"s{seed}-{index:04d}", index, system, task, tuple(turns))
        sessions.append(_with_subagents(session, spec, seed) if spec.subagent_prob > 0 else session)
    return Workload(spec, seed, tuple(sessions))


def _with_subagents(session: SessionPlan, spec: WorkloadSpec, seed: int) -> SessionPlan:
    """`session` with a subagent run at each tool call that draws one (`subagent_prob`),
    from the session's own streams: the main threads stay those of the same spec without
    subagents. A subagent's run takes its tool call's place (that call's latency is 0)."""
    rng = random.Random(f"{seed}:{session.index}:subagents")
    latency_rng = random.Random(f"{seed}:{session.index}:subagents:tool-latency")
    turns = list(session.turns)
    subagents: list[tuple[int, SessionPlan]] = []
    for k, turn in enumerate(session.turns[:-1]):
        if rng.random() >= spec.subagent_prob:
            continue
        number = len(subagents) + 1
        sub_turns = []
        for index in range(1, spec.subagent_turns + 1):
            last = index == spec.subagent_turns
            result = (
                None if last else random_words(rng, rng.randint(spec.tool_result_words_min, spec.tool_result_words_max))
            )
            sub_turns.append(TurnPlan(index, result, 0.0 if last else sample_tool_latency(latency_rng, spec), None))
        system = f"You are subagent {number} of agent {session.index}. " + random_words(rng, spec.system_prompt_words)
        task = f"Subtask {number}: " + random_words(rng, spec.task_words)
        subagents.append((turn.index, SessionPlan(session.session_id, session.index, system, task, tuple(sub_turns))))
        turns[k] = replace(turn, tool_latency_s=0.0)
    return replace(session, turns=tuple(turns), subagents=tuple(subagents))


def workload_from_trace(trace: AgentTrace, send_finish: bool = False) -> Workload:
    """The agent trace `trace` as text: one word per token, the trace's closed loop of
    `agents` as the driver's `concurrency` (a session starts when one ends).

    Deterministic: the text comes from a stream seeded by the trace's seed. The shared
    system prompt and every session's task and tool results have the trace's token
    counts in words (about one token each); each turn's max_tokens is its output length.
    """
    rng = random.Random(f"{trace.seed}:trace-text")
    spec = trace.spec
    outputs = sorted(turn.output_tokens for session in trace.sessions for turn in session.turns)
    workload_spec = WorkloadSpec(
        sessions=spec.sessions,
        concurrency=spec.agents,
        turns_min=min(len(s.turns) for s in trace.sessions),
        turns_max=max(len(s.turns) for s in trace.sessions),
        system_prompt_words=trace.system_prompt_tokens,
        shared_system_prompt=True,
        task_words=max(1, trace.spec.scaled(spec.task_tokens)),
        tool_result_words_min=1,
        tool_result_words_max=max([t.tool_result_tokens for s in trace.sessions for t in s.turns] + [1]),
        reply_tokens=outputs[len(outputs) // 2],  # the median; every turn sets its own
        tool_latency_median_s=spec.tool_time_median_s * spec.time_scale,
        tool_latency_sigma=spec.tool_time_sigma,
        send_finish=send_finish,
    )
    system = random_words(rng, trace.system_prompt_tokens)
    sessions = []
    for session in trace.sessions:
        task = f"Task {session.index}: " + random_words(rng, session.task_tokens)
        turns = tuple(
            TurnPlan(
                turn.index,
                random_words(rng, turn.tool_result_tokens) if turn.index < len(session.turns) else None,
                turn.tool_time_s,
                None,
                turn.output_tokens,
            )
            for turn in session.turns
        )
        sessions.append(SessionPlan(f"t{trace.seed}-{session.index:04d}", session.index, system, task, turns))
    return Workload(workload_spec, trace.seed, tuple(sessions))


def build_messages(session: SessionPlan, replies: list[str], turn_index: int) -> list[dict]:
    """The chat messages of turn `turn_index` (1-based), given the replies received so far.

    `replies[j]` is the reply text of turn j+1 exactly as the server returned it, so the
    rendered prompt repeats what the replica cached for the previous turn.
    """
    if len(replies) < turn_index - 1:
        raise ValueError(f"turn {turn_index} needs {turn_index - 1} earlier replies, got {len(replies)}")
    messages = [{"role": "system", "content": session.system_prompt}, {"role": "user", "content": session.task}]
    for earlier in session.turns[: turn_index - 1]:
        messages.append({"role": "assistant", "content": replies[earlier.index - 1]})
        messages.append({"role": "user", "content": "Tool result: " + (earlier.tool_result or "")})
    return messages
