"""A multi-turn agentic workload for the end-to-end test (runs in the main venv).

Each session re-sends its whole history every turn: a session-unique system prompt,
then per turn a new user/tool message of about ``turn_words`` words and a fixed-size
assistant reply. The assistant text is deterministic rather than the model's output,
so both runs of a comparison send byte-identical prompts and the tiny random model's
re-tokenisation quirks cannot differ between them. Sessions start within
``start_spread_sec`` of each other and wait a tool latency of 0.5-1.5 x
``tool_latency_sec`` between turns (seeded, so both runs see the same timings); the
session id travels in the ``x-session-id`` header, and with ``send_finish`` the last
turn carries ``x-session-finish: true`` (docs/reference.md); without it no turn
does, as with an agent built on a plain OpenAI SDK.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

SYLLABLES = ["ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "in", "ex", "qu", "ab", "ze", "pol", "rit"]


def words(count: int, rng: random.Random) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count))


@dataclass(frozen=True)
class WorkloadShape:
    sessions: int = 8
    turns: int = 8
    system_words: int = 220
    turn_words: int = 28
    reply_words: int = 6
    max_tokens: int = 16
    tool_latency_sec: float = 0.3
    start_spread_sec: float = 1.0
    model: str = "tiny"
    request_timeout_sec: float = 600.0
    send_finish: bool = True


@dataclass
class WorkloadResult:
    wall_sec: float = 0.0
    turns_ok: int = 0
    failures: list[str] = field(default_factory=list)
    admissions: Counter = field(default_factory=Counter)
    wait_ms: list[float] = field(default_factory=list)
    turn_sec: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SessionScript:
    """Everything one session sends and waits, fixed by (session, shape, seed)."""

    system: str
    users: list[str]
    replies: list[str]
    start_delay_sec: float
    tool_latencies_sec: list[float]


def session_script(session: int, shape: WorkloadShape, seed: int) -> SessionScript:
    """The session's prompts and timings; pure and deterministic."""
    rng = random.Random(f"{seed}-{session}")
    return SessionScript(
        system=f"session {session} agent. " + words(shape.system_words, rng),
        users=[f"tool result {turn}: " + words(shape.turn_words, rng) for turn in range(shape.turns)],
        replies=[f"step {turn} done " + words(shape.reply_words, rng) for turn in range(shape.turns)],
        start_delay_sec=rng.uniform(0, shape.start_spread_sec),
        tool_latencies_sec=[shape.tool_latency_sec * rng.uniform(0.5, 1.5) for _ in range(shape.turns)],
    )


async def _run_session(
    http: aiohttp.ClientSession, base_url: str, session: int, shape: WorkloadShape, seed: int, result: WorkloadResult
) -> None:
    script = session_script(session, shape, seed)
    messages = [{"role": "system", "content": script.system}]
    session_id = f"e2e-{seed}-{session}"
    await asyncio.sleep(script.start_delay_sec)
    for turn in range(shape.turns):
        messages.append({"role": "user", "content": script.users[turn]})
        body = {"model": shape.model, "messages": messages, "max_tokens": shape.max_tokens, "ignore_eos": True}
        headers = {"x-session-id": session_id}
        if shape.send_finish and turn == shape.turns - 1:
            headers["x-session-finish"] = "true"
        started = time.monotonic()
        async with http.post(base_url + "/v1/chat/completions", json=body, headers=headers) as response:
            payload = await response.read()
            if response.status != 200:
                result.failures.append(f"session {session} turn {turn}: {response.status} {payload[:300]!r}")
                return
            if "x-kvgate-admission" in response.headers:
                result.admissions[response.headers["x-kvgate-admission"]] += 1
                result.wait_ms.append(float(response.headers.get("x-kvgate-wait-ms", "0")))
        result.turn_sec.append(time.monotonic() - started)
        result.turns_ok += 1
        messages.append({"role": "assistant", "content": script.replies[turn]})
        await asyncio.sleep(script.tool_latencies_sec[turn])


async def run_workload(base_url: str, shape: WorkloadShape, seed: int = 0) -> WorkloadResult:
    """Run every session concurrently against ``base_url`` (vLLM or kvgate)."""
    result = WorkloadResult()
    timeout = aiohttp.ClientTimeout(total=shape.request_timeout_sec)
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(
            *(_run_session(http, base_url, session, shape, seed, result) for session in range(shape.sessions))
        )
    result.wall_sec = time.monotonic() - started
    return result
