"""Policies over several workload seeds, each against a baseline policy on the same seed.

One seed is one draw of the workload: which sessions, how many turns, how long their
tool calls. A policy that wins on one draw can lose on another (where its placement put
the run's longest chain of sessions, say), so a change is judged over several draws,
each policy against the baseline (`sticky` where it runs) on the same draw.
`kvgate sim cluster --seeds` runs them; these are pure functions of the runs'
summaries (`report.summarize`).
"""

from __future__ import annotations

import statistics

# The figures compared with the baseline's (lower is better for each): name, summary path.
RATIOS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("makespan", ("makespan_s",)),
    ("session p95", ("session_completion_s", "p95")),
    ("turn mean", ("turn_latency_s", "mean")),
)


def parse_seeds(text: str) -> list[int]:
    """`--seeds`: a comma list of seeds and ranges (`0,3,5-7`; a seed is an integer >= 0), in
    the order given, each once. Raises ValueError naming what is wrong."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        try:
            span = range(int(first), int(last) + 1) if dash else range(int(first), int(first) + 1)
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not a seed or a range A-B of seeds") from None
        if not span:
            raise ValueError(f"--seeds: {part!r} is an empty range (A-B needs A <= B)")
        seeds.extend(s for s in span if s not in seeds)
    if len(seeds) < 2:
        raise ValueError(f"--seeds needs two seeds or more (got {text!r}); one seed is --seed")
    return seeds


def baseline_of(policies: list[str]) -> str:
    """The policy the others are measured against: sticky where it runs, else the first."""
    return "sticky" if "sticky" in policies else policies[0]


def _figure(summary: dict, path: tuple[str, ...]) -> float | None:
    value: object = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def seed_ratios(by_seed: dict[int, dict[str, dict]], baseline: str) -> dict[str, dict[str, list[float | None]]]:
    """Per policy and figure (`RATIOS`): its value over the baseline's on each seed, in seed
    order (None where either is missing or the baseline's is 0)."""
    policies = list(next(iter(by_seed.values())))
    out: dict[str, dict[str, list[float | None]]] = {}
    for policy in policies:
        out[policy] = {}
        for name, path in RATIOS:
            ratios: list[float | None] = []
            for summaries in by_seed.values():
                mine, base = _figure(summaries[policy], path), _figure(summaries[baseline], path)
                ratios.append(round(mine / base, 4) if mine is not None and base else None)
            out[policy][name] = ratios
    return out


def _mean_worst(ratios: list[float | None]) -> str:
    known = [r for r in ratios if r is not None]
    if not known:
        return "-"
    each = " ".join("-" if r is None else f"{r:.2f}" for r in ratios)
    return f"{statistics.mean(known):.3f} / {max(known):.2f} ({each})"


def format_seeds(by_seed: dict[int, dict[str, dict]], baseline: str) -> str:
    """Policy x figure: the mean and the worst (highest) of its ratios to the baseline over the
    seeds, then each seed's; and the hit rate's mean and lowest."""
    ratios = seed_ratios(by_seed, baseline)
    seeds = ", ".join(str(s) for s in by_seed)
    header = " | ".join(f"{name} × {baseline}: mean / worst (each seed)" for name, _ in RATIOS)
    lines = [
        f"Seeds {seeds}; every figure over {baseline}'s on the same seed.",
        "",
        f"| policy | {header} | hit rate: mean (lowest) |",
        "|---|" + "---|" * len(RATIOS) + "---|",
    ]
    for policy, figures in ratios.items():
        hits = [h for h in (_figure(s[policy], ("hit_rate",)) for s in by_seed.values()) if h is not None]
        hit = f"{statistics.mean(hits):.3f} ({min(hits):.3f})" if hits else "-"
        cells = " | ".join(_mean_worst(figures[name]) for name, _ in RATIOS)
        lines.append(f"| {policy} | {cells} | {hit} |")
    return "\n".join(lines) + "\n"
