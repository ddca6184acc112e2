"""Agent traffic as published traces describe it: a pure, seeded generator of sessions.

A run is a closed loop of `agents`: each agent runs one session at a time and starts
the next session as soon as its last one ends, so sessions start and end all through
a run, and nothing announces either. Every session sends the same system prompt (an
agent scaffold's instructions and tool descriptions), then its own task, then turns.
Turn k's prompt is the whole history: system, task, and for every earlier turn j its
reply (`output_tokens`) and the tool result appended after it. Between turns the agent
runs a tool for `tool_time_s`.

Distributions (all lognormal; each is fitted to a published figure, the other
parameter is a stated choice):
- turns per session: mean 17.9 (SWE-smith trajectories), sigma 0.7, 1..`turns_max`;
- tokens per turn: the prompt's median over all turns is 6,945 (SWE-smith) given the
  system prompt and task sizes below; the tool results' median is fitted to it
  (`tests/simulator/test_agent_trace.py` checks the fit), sigma 1.0;
- output tokens per turn: median 30 (SWE-smith), sigma 0.8;
- tool time: 86% of follow-ups within 1 s and 95% within 10 s (a coding-agent trace),
  which gives median 12 ms and sigma 4.08: a heavy tail, clamped at `tool_time_max_s`
  (2.8% of calls above 30 s; the two fitted quantiles lie below the clamp, so it keeps
  them).

Invariants:
- `generate_trace(spec, seed)` is a pure function: the same spec and seed give an equal
  `AgentTrace`. Three `random.Random` streams, each consumed in a fixed order: shape
  (turn counts, tool-result and output sizes), tool times, and nothing else. So changing
  a time setting keeps every session's tokens.
- Token counts are model tokens. `token_scale` f divides every token count (system
  prompt, task, tool results and outputs) by f, at least 1 token each. Run it on
  replicas coarsened by the same f (`CostPreset.scaled`: cache and step budget / f,
  every cost x f): one scaled token stands for f tokens and one scaled step for f
  steps, so context-to-cache and prefill-to-decode ratios stay the real run's.
- `time_scale` multiplies tool times; set it to the replicas' time scale so that tool
  time keeps its ratio to engine time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields
from statistics import NormalDist

_NORMAL = NormalDist()


@dataclass(frozen=True)
class Lognormal:
    """exp(N(ln median, sigma²)), optionally clamped to [low, high]."""

    median: float
    sigma: float
    low: float = 0.0
    high: float = math.inf

    @classmethod
    def from_quantiles(cls, p1: float, x1: float, p2: float, x2: float, **bounds: float) -> Lognormal:
        """The lognormal with P(X <= x1) = p1 and P(X <= x2) = p2 (0 < p1 < p2 < 1, 0 < x1 < x2)."""
        if not (0 < p1 < p2 < 1 and 0 < x1 < x2):
            raise ValueError(f"need 0 < p1 < p2 < 1 and 0 < x1 < x2, got p={p1},{p2} x={x1},{x2}")
        z1, z2 = _NORMAL.inv_cdf(p1), _NORMAL.inv_cdf(p2)
        sigma = (math.log(x2) - math.log(x1)) / (z2 - z1)
        return cls(math.exp(math.log(x1) - z1 * sigma), sigma, **bounds)

    @classmethod
    def from_mean(cls, mean: float, sigma: float, **bounds: float) -> Lognormal:
        """The (unclamped) lognormal of this mean and sigma."""
        return cls(mean / math.exp(sigma * sigma / 2), sigma, **bounds)

    def cdf(self, x: float) -> float:
        """P(X <= x) of the unclamped distribution."""
        return 0.0 if x <= 0 else _NORMAL.cdf((math.log(x) - math.log(self.median)) / self.sigma)

    def sample(self, rng: random.Random) -> float:
        return min(self.high, max(self.low, self.median * math.exp(rng.gauss(0.0, self.sigma))))


# 86% of follow-ups within 1 s, 95% within 10 s.
TOOL_TIME_FIT = Lognormal.from_quantiles(0.86, 1.0, 0.95, 10.0)


@dataclass(frozen=True)
class AgentTraceSpec:
    """Shape of a trace workload; token counts are unscaled model tokens."""

    sessions: int = 96  # sessions in the whole run
    agents: int = 48  # closed loop: sessions running at once
    system_prompt_tokens: int = 2000  # shared by every session
    task_tokens: int = 500
    turns_mean: float = 17.9
    turns_sigma: float = 0.7
    turns_max: int = 100
    tool_result_median_tokens: float = 275.0  # fitted: prompt median 6,945 over all turns
    tool_result_sigma: float = 1.0
    tool_result_max_tokens: int = 16000
    output_median_tokens: float = 30.0
    output_sigma: float = 0.8
    output_max_tokens: int = 1024
    tool_time_median_s: float = TOOL_TIME_FIT.median
    tool_time_sigma: float = TOOL_TIME_FIT.sigma
    tool_time_max_s: float = 30.0
    token_scale: float = 1.0  # f: every token count / f (see the module invariants)
    time_scale: float = 1.0  # multiplies tool times

    def validate(self) -> AgentTraceSpec:
        """Return self, or raise ValueError naming the first field out of range."""
        checks = [
            ("sessions", self.sessions >= 1),
            ("agents", self.agents >= 1),
            ("system_prompt_tokens", self.system_prompt_tokens >= 0),
            ("task_tokens", self.task_tokens >= 1),
            ("turns_mean", self.turns_mean >= 1),
            ("turns_sigma", self.turns_sigma >= 0),
            ("turns_max", self.turns_max >= 1),
            ("tool_result_median_tokens", self.tool_result_median_tokens >= 1),
            ("tool_result_sigma", self.tool_result_sigma >= 0),
            ("tool_result_max_tokens", self.tool_result_max_tokens >= 1),
            ("output_median_tokens", self.output_median_tokens >= 1),
            ("output_sigma", self.output_sigma >= 0),
            ("output_max_tokens", self.output_max_tokens >= 1),
            ("tool_time_median_s", self.tool_time_median_s >= 0),
            ("tool_time_sigma", self.tool_time_sigma >= 0),
            ("tool_time_max_s", self.tool_time_max_s >= 0),
            ("token_scale", self.token_scale >= 1),
            ("time_scale", self.time_scale >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"agent trace: {name}={getattr(self, name)!r} is out of range")
        return self

    def replace(self, **changes) -> AgentTraceSpec:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"agent trace: unknown field(s) {unknown}; known: {sorted(known)}")
        return AgentTraceSpec(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})

    def scaled(self, tokens: float) -> int:
        """A context part of `tokens` unscaled tokens after `token_scale` (at least 1 unless 0)."""
        return 0 if tokens <= 0 else max(1, round(tokens / self.token_scale))


@dataclass(frozen=True)
class TraceTurn:
    index: int  # 1-based
    output_tokens: int  # the reply's length (max_tokens)
    tool_result_tokens: int  # appended after the reply; 0 on the last turn
    tool_time_s: float  # from the reply's end to the next turn; 0 on the last turn


@dataclass(frozen=True)
class TraceSession:
    index: int
    task_tokens: int
    turns: tuple[TraceTurn, ...]


@dataclass(frozen=True)
class AgentTrace:
    spec: AgentTraceSpec
    seed: int
    system_prompt_tokens: int
    sessions: tuple[TraceSession, ...] = field(default_factory=tuple)

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def prompt_tokens(self, session: TraceSession) -> list[int]:
        """Each turn's prompt length: system + task + every earlier reply and tool result."""
        total = self.system_prompt_tokens + session.task_tokens
        lengths = []
        for turn in session.turns:
            lengths.append(total)
            total += turn.output_tokens + turn.tool_result_tokens
        return lengths


def generate_trace(spec: AgentTraceSpec, seed: int) -> AgentTrace:
    """The deterministic trace of `spec` for `seed` (see the module invariants)."""
    spec.validate()
    shape = random.Random(f"{seed}:trace-shape")
    times = random.Random(f"{seed}:trace-tool-time")
    turns_dist = Lognormal.from_mean(spec.turns_mean, spec.turns_sigma)
    results = Lognormal(spec.tool_result_median_tokens, spec.tool_result_sigma, 1, spec.tool_result_max_tokens)
    outputs = Lognormal(spec.output_median_tokens, spec.output_sigma, 1, spec.output_max_tokens)
    tool_time = Lognormal(spec.tool_time_median_s, spec.tool_time_sigma, 0.0, spec.tool_time_max_s)
    sessions = []
    for index in range(spec.sessions):
        count = min(spec.turns_max, max(1, round(turns_dist.sample(shape))))
        task = spec.scaled(spec.task_tokens)
        turns = []
        for k in range(1, count + 1):
            last = k == count
            output = spec.scaled(outputs.sample(shape))
            result = 0 if last else spec.scaled(results.sample(shape))
            wait = 0.0 if last else tool_time.sample(times) * spec.time_scale
            turns.append(TraceTurn(k, output, result, wait))
        sessions.append(TraceSession(index, task, tuple(turns)))
    return AgentTrace(spec, seed, spec.scaled(spec.system_prompt_tokens), tuple(sessions))
