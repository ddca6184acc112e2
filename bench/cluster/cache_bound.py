"""How much of the hit-rate ceiling a run's caches could hold at all: a bound from block-seconds.

A turn hits its session's last context only if those blocks stayed in a cache from the
end of the session's previous turn to its own start: at least the tool call between them
(a gate's wait only lengthens it). Keeping `t` tokens for `g` seconds costs `t * g`
token-seconds, and a run's caches have `cache tokens x makespan` of them in all. What
the turns share with other sessions (a system prompt) is one copy per replica, and
counted as hit for free.

Relaxed that far (every replica's cache pooled, blocks packed perfectly in time, the
running turns' own blocks not counted), this is a fractional knapsack over the turns:
value `t`, cost `t * g`, so keeping the windows with the shortest tool calls first is
optimal. Two bounds come out of it:

- `foresight`: that optimum, for a policy that knows how long every tool call will
  take. No policy that serves these turns, with these tool calls, hits more.
- `same_time`: every window kept the same time at most (a TTL, the longest the budget
  allows), for a policy that does not know when a tool call ends. vLLM's LRU eviction
  behaves close to this (Che's approximation).

Pure functions of the run's turn records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.bench.cluster.run import TurnRecord, session_turns, tool_call_s
from kvgate.simulator.virtual_engine import SimEngine


@dataclass(frozen=True, slots=True)
class Window:
    """A session's context kept across one tool call: `tokens` its own (not shared) tokens the
    next turn could hit, `gap_s` the seconds between the turns."""

    tokens: int
    gap_s: float


def windows_of(turns: list[TurnRecord]) -> list[Window]:
    """Each completed turn after a session's first: what its previous turn left it, and for how long."""
    out = []
    for records in session_turns(turns):
        for before, turn in zip(records, records[1:]):
            if not turn.ok or before.turn != turn.turn - 1 or not before.ok:
                continue
            own = turn.ceiling_tokens - turn.shared_tokens
            if own > 0:
                out.append(Window(own, tool_call_s(before, turn)))
    return out


def kept_by_foresight(windows: list[Window], budget: float) -> float:
    """Tokens hit keeping the windows with the shortest gaps first within `budget` token-seconds
    (the last one in part): the fractional knapsack's optimum."""
    kept = 0.0
    for window in sorted(windows, key=lambda w: w.gap_s):
        cost = window.tokens * window.gap_s
        if cost <= budget:
            kept += window.tokens
            budget -= cost
        else:
            kept += window.tokens * budget / cost
            break
    return kept


def kept_for_same_time(windows: list[Window], budget: float) -> float:
    """Tokens hit keeping every window up to the same time (a TTL), the longest `budget`
    allows: a window whose gap is within it is hit, a longer one costs the TTL and is lost."""
    ordered = sorted(windows, key=lambda w: w.gap_s)
    unkept = sum(w.tokens for w in ordered)  # tokens of the windows from here on
    spent = 0.0  # token-seconds of the windows before here, each kept its whole gap
    kept = 0
    for window in ordered:
        # a TTL of this window's gap: the windows before cost their gaps, this one and the rest the TTL
        if spent + unkept * window.gap_s > budget:
            return kept  # the TTL the budget allows ends before this gap: no later window is hit
        spent += window.tokens * window.gap_s
        kept += window.tokens
        unkept -= window.tokens
    return kept


def decoding_token_seconds(turns: list[TurnRecord]) -> float:
    """Token-seconds the turns' own prompts held while they decoded (from the first token to
    the end): the least the running turns take of the caches, and no idle window's to use."""
    return sum(
        (t.prompt_tokens - t.shared_tokens) * max(0.0, t.end_s - t.start_s - t.ttft_s)
        for t in turns
        if t.ttft_s is not None
    )


def hit_bounds(ok: list[TurnRecord], engines: Iterable[SimEngine], makespan: float) -> dict | None:
    """The hit-rate bounds of a run's completed turns `ok` on `engines` over `makespan` seconds,
    as shares of their ceiling: {"foresight", "same_time"}; None without turns to bound."""
    ceiling = sum(t.ceiling_tokens for t in ok)
    if not ceiling:
        return None
    cache_tokens = sum((e.config.num_blocks + e.config.cpu_blocks) * e.config.block_size for e in engines)
    budget = cache_tokens * makespan - decoding_token_seconds(ok)
    shared = sum(t.shared_tokens for t in ok)
    windows = windows_of(ok)
    return {
        "foresight": round((shared + kept_by_foresight(windows, budget)) / ceiling, 4),
        "same_time": round((shared + kept_for_same_time(windows, budget)) / ceiling, 4),
    }
