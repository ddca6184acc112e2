"""Agent sessions as the cluster simulation needs them: token counts, body sizes, tool times.

Two sources, one shape (`SessionTokens`):

- `sessions_of(workload)`: the agentic benchmark's own sessions (`bench.agentic.workload`),
  rendered with the simulated replica's tokenizer and chat template exactly as the
  benchmark's turns render (so prompt sizes, the prefix shared between sessions and
  the bodies' JSON sizes are the benchmark's). For a run of a fixed list of sessions.
- `AgentSessions`: endless sessions for agents in a closed loop, drawn from the same
  `WorkloadSpec` distributions without writing their text (each word one token, as
  the benchmark's words are): session j of agent a comes from its own seeded stream,
  so an agent's sessions do not depend on what the others did.

A session's token sequence only grows: turn k+1's prompt is turn k's prompt, its reply,
and the tool result in the template's markers (`<|end|> <|user|> ... <|end|> <|assistant|>`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson

from kvgate.bench.agentic.apis import turn_request
from kvgate.bench.agentic.workload import SessionPlan, Workload, WorkloadSpec, build_messages, sample_tool_latency
from kvgate.simulator import tokenizer
from kvgate.simulator.agent_trace import AgentTrace

# Tokens the chat template adds around a reply and the tool result that follows it:
# <|end|> after the reply, <|user|> ... <|end|> around the result, <|assistant|> to generate.
TURN_MARKER_TOKENS = 4
TOOL_RESULT_LABEL = "Tool result: "


@dataclass(frozen=True, slots=True)
class SessionTokens:
    """One session: `prompts[k]` tokens and `body_bytes[k]` JSON bytes for turn k+1,
    `tool_latency_s[k]` seconds of tool call after it, `replies[k]` tokens of its reply;
    `shared_prefix` = (prefix id, tokens every session of that prefix starts with);
    `max_tokens`: the cap its turns send (None: each turn its reply's length)."""

    sequence_id: int
    session_id: str
    shared_prefix: tuple[int, int]
    prompts: tuple[int, ...]
    body_bytes: tuple[int, ...]
    tool_latency_s: tuple[float, ...]
    replies: tuple[int, ...]
    max_tokens: int | None = None
    # (turn number n, 1-based: the subagent thread the tool call after turn n runs), under `session_id`
    subagents: tuple[tuple[int, SessionTokens], ...] = ()

    @property
    def turns(self) -> int:
        return len(self.prompts)

    def subagent_after(self, turn: int) -> SessionTokens | None:
        """The subagent thread the tool call after turn `turn` (1-based) runs, if it runs one."""
        return next((thread for after, thread in self.subagents if after == turn), None)


def _reply_text(start: int, count: int) -> str:
    """The simulated replica's reply to a prompt of `start` tokens (content is a function of position)."""
    return "".join(tokenizer.decode_token(tokenizer.output_token(position)) for position in range(start, start + count))


# A subagent thread's sequence id: its number above these bits, its session's index below.
_SUBAGENT_SHIFT = 24


def sessions_of(workload: Workload) -> list[SessionTokens]:
    """The benchmark workload's sessions, rendered exactly (the replica's tokenizer and template)."""
    firsts = [tokenizer.render_chat({"messages": build_messages(s, [], 1)}) for s in workload.sessions]
    out = []
    for session, first in zip(workload.sessions, firsts):
        # what it shares with another session (session 0, or for session 0 itself session 1)
        other = firsts[1 if session.index == 0 else 0] if len(firsts) > 1 else None
        subagents = tuple(
            (after, _thread_of(workload, plan, (number << _SUBAGENT_SHIFT) | session.index, other))
            for number, (after, plan) in enumerate(session.subagents, start=1)
        )
        out.append(_thread_of(workload, session, session.index, other, first, subagents))
    return out


def _thread_of(
    workload: Workload,
    thread: SessionPlan,
    sequence_id: int,
    other_first: list[int] | None,
    first: list[int] | None = None,
    subagents: tuple[tuple[int, SessionTokens], ...] = (),
) -> SessionTokens:
    """One thread of a session (its main thread or a subagent's), rendered exactly."""
    spec = workload.spec
    reply = spec.reply_tokens
    if first is None:
        first = tokenizer.render_chat({"messages": build_messages(thread, [], 1)})
    shared = _common_prefix(first, other_first) if other_first is not None else 0
    replies: list[str] = []
    prompts, sizes = [], []
    prompt = len(first)
    for turn in thread.turns:
        if turn.index > 1:
            earlier = thread.turns[turn.index - 2]
            tool = tokenizer.encode(TOOL_RESULT_LABEL + (earlier.tool_result or ""))
            prompt += reply + len(tool) + TURN_MARKER_TOKENS
        prompts.append(prompt)
        body, _ = turn_request("chat", "sim", thread, turn.index, replies, reply, None, spec.max_tokens, spec.stop)
        sizes.append(len(orjson.dumps(body)))
        replies.append(_reply_text(prompt, reply))
    return SessionTokens(
        sequence_id,
        thread.session_id,
        (0, shared),
        tuple(prompts),
        tuple(sizes),
        tuple(turn.tool_latency_s for turn in thread.turns),
        (reply,) * len(prompts),
        spec.max_tokens,
        subagents,
    )


# A model token stands for about 4 bytes of English text or code in a request body.
TRACE_BYTES_PER_TOKEN = 4


def sessions_of_trace(trace: AgentTrace) -> list[SessionTokens]:
    """An agent trace's sessions (`simulator.agent_trace`): its token counts as they are,
    every session sharing the system prompt, body sizes at TRACE_BYTES_PER_TOKEN."""
    out = []
    for session in trace.sessions:
        prompts = tuple(trace.prompt_tokens(session))
        out.append(
            SessionTokens(
                session.index,
                f"t{trace.seed}-{session.index:05d}",
                (0, trace.system_prompt_tokens),
                prompts,
                tuple(_BODY_OVERHEAD_BYTES + TRACE_BYTES_PER_TOKEN * prompt for prompt in prompts),
                tuple(turn.tool_time_s for turn in session.turns),
                tuple(turn.output_tokens for turn in session.turns),
            )
        )
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# Word-count model of the endless sessions (the benchmark's words are 1-3 two-letter
# syllables and a space: 5 bytes on average, one token each).
BYTES_PER_WORD = 5
_BODY_OVERHEAD_BYTES = 160  # model, max_tokens, stream options, the first two messages' JSON
_MESSAGE_OVERHEAD_BYTES = 32  # {"role":"assistant","content":""}, and a comma
_REPLY_BYTES_PER_TOKEN = 6  # the replica's output words (" model", " cache", ...)


class AgentSessions:
    """Endless sessions of `spec`'s shape for agents in a closed loop (see the module docstring).

    With `shared_system_prompt`, every session starts with the same system prompt (one
    shared prefix); otherwise only a few template tokens, less than a block.
    `token_scale` f divides every word count and the reply length by f (at least 1), for
    engines coarsened by the same f (`CostPreset.scaled`): one token stands for f, and a
    body's bytes describe the scaled text, so the gate's byte bound still bounds it.
    """

    def __init__(self, spec: WorkloadSpec, seed: int, token_scale: float = 1.0) -> None:
        spec.validate()
        if spec.subagent_prob > 0:
            raise ValueError(
                "endless agents run no subagents (subagent_prob must be 0); run a fixed list of sessions for them"
            )
        if token_scale < 1:
            raise ValueError(f"token scale must be >= 1 (got {token_scale})")
        self.spec = spec
        self.seed = seed
        self.token_scale = token_scale

    def _scaled(self, count: float) -> int:
        return max(1, round(count / self.token_scale))

    def session(self, agent: int, number: int) -> SessionTokens:
        spec = self.spec
        scaled = self._scaled
        rng = random.Random(f"{self.seed}:{agent}:{number}")
        latency_rng = random.Random(f"{self.seed}:{agent}:{number}:tool-latency")
        system = scaled(spec.system_prompt_words + 4)  # "You are agent." (+ its index when not shared)
        task = scaled(spec.task_words + 3)  # "Task N:"
        reply = scaled(spec.reply_tokens)
        # <|bos|> <|system|> system <|end|> <|user|> task <|end|> <|assistant|>
        prompt = system + task + 6
        shared = system + 4 if spec.shared_system_prompt else 5  # up to "<|user|> Task"
        size = _BODY_OVERHEAD_BYTES + BYTES_PER_WORD * (system + task)
        turns = rng.randint(spec.turns_min, spec.turns_max)
        prompts, sizes, latencies = [], [], []
        for index in range(turns):
            prompts.append(prompt)
            sizes.append(size)
            last = index == turns - 1
            latencies.append(0.0 if last else sample_tool_latency(latency_rng, spec))
            result = scaled(rng.randint(spec.tool_result_words_min, spec.tool_result_words_max) + 3)
            prompt += reply + result + TURN_MARKER_TOKENS
            size += 2 * _MESSAGE_OVERHEAD_BYTES + _REPLY_BYTES_PER_TOKEN * reply + BYTES_PER_WORD * result
        sequence = (agent << 24) | number
        return SessionTokens(
            sequence,
            f"a{agent:05d}-{number:05d}",
            (0, shared),
            tuple(prompts),
            tuple(sizes),
            tuple(latencies),
            (reply,) * turns,
            None if spec.max_tokens is None else scaled(spec.max_tokens),
        )
