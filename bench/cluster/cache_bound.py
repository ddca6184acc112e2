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
- `no_foresight`: the optimum for a policy that does not know when a tool call ends.
  The workloads draw each tool call's length on its own, apart from everything a gate
  sees, so such a policy can only decide, for each window, how long to keep it (its
  TTL), and the TTL it picks tells nothing of the gap. A window kept for `T` costs
  `t * min(g, T)` and is hit if `g <= T`. Mixing TTLs across windows (some kept long,
  others not at all) reaches any point on the upper concave hull of the single-TTL
  points (token-seconds spent, tokens hit), and no point above it. vLLM's LRU eviction
  behaves close to one TTL for every window (Che's approximation), which may be below
  the hull.

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


def ttl_points(windows: list[Window]) -> list[tuple[float, float]]:
    """(token-seconds spent, tokens hit) keeping every window up to one TTL, for a TTL of
    zero and of each window's gap in turn: with a TTL of `T`, a window of gap `g <= T` costs
    `t * g` and is hit, a longer one costs `t * T` and is lost."""
    ordered = sorted(windows, key=lambda w: w.gap_s)
    unkept = sum(w.tokens for w in ordered)  # tokens of the windows from here on
    spent = 0.0  # token-seconds of the windows before here, each kept its whole gap
    kept = 0
    points = [(0.0, 0.0)]
    for window in ordered:
        # a TTL of this window's gap: the windows before cost their gaps, this one and the rest the TTL
        kept += window.tokens
        points.append((spent + unkept * window.gap_s, float(kept)))
        spent += window.tokens * window.gap_s
        unkept -= window.tokens
    return points


def upper_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The upper concave hull of `points`, sorted by their first coordinate (Andrew's monotone chain)."""
    hull: list[tuple[float, float]] = []
    for x, y in sorted(points):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) < 0:
                break  # the middle point lies above the chord: it stays on the hull
            hull.pop()
        hull.append((x, y))
    return hull


def kept_without_foresight(windows: list[Window], budget: float) -> float:
    """Tokens hit by the best mix of TTLs within `budget` token-seconds: the upper hull of
    `ttl_points` at `budget` (`no_foresight` of the module docstring)."""
    hull = upper_hull(ttl_points(windows))
    for (x1, y1), (x2, y2) in zip(hull, hull[1:]):
        if budget <= x2:
            if x2 == x1:  # windows of no gap: hit for nothing
                return y2
            return y1 + (y2 - y1) * max(0.0, budget - x1) / (x2 - x1)
    return hull[-1][1]


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
    as shares of their ceiling: {"foresight", "no_foresight"}; None without turns to bound."""
    ceiling = sum(t.ceiling_tokens for t in ok)
    if not ceiling:
        return None
    cache_tokens = sum((e.config.num_blocks + e.config.cpu_blocks) * e.config.block_size for e in engines)
    budget = cache_tokens * makespan - decoding_token_seconds(ok)
    shared = sum(t.shared_tokens for t in ok)
    windows = windows_of(ok)
    return {
        "foresight": round((shared + kept_by_foresight(windows, budget)) / ceiling, 4),
        "no_foresight": round((shared + kept_without_foresight(windows, budget)) / ceiling, 4),
    }
