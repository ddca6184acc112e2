"""`--sweep`: a grid over the gate's settings, and the choice of the best settings.

The grid is `high_watermark` x `hit_threshold` x `idle_grace_sec` (the watermark policy's
settings; the working_set policy reads `idle_grace_sec`), plus `headroom_blocks` (the
working_set policy's W) when asked for more than its one default value.

Each grid point is one run of a kvgate mode on fresh replicas with the same workload.
The best point of a mode is the one with the smallest makespan among those with no
failed turn, ties broken by the higher hit rate; a grid where every point failed a
turn still reports its least bad point, flagged.
"""

from __future__ import annotations

import itertools

SWEPT_SETTINGS = ("high_watermark", "hit_threshold", "idle_grace_sec", "headroom_blocks")
DEFAULT_GRID = {
    "high_watermark": (0.75, 0.9),
    "hit_threshold": (0.5, 0.8),
    "idle_grace_sec": (1.0, 5.0),
    "headroom_blocks": (0,),  # the working_set policy's watermark W; a single value unless asked
}
INTEGER_SETTINGS = {"headroom_blocks"}


def grid_points(grid: dict[str, tuple[float, ...]]) -> list[dict]:
    """Every combination of the grid's values, in a stable order."""
    names = [k for k in SWEPT_SETTINGS if k in grid]
    return [dict(zip(names, values)) for values in itertools.product(*(grid[k] for k in names))]


def parse_values(text: str, name: str) -> tuple[float, ...]:
    kind = int if name in INTEGER_SETTINGS else float
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--sweep-{name.replace('_', '-')}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"--sweep-{name.replace('_', '-')}: give at least one value")
    return values


def best_point(rows: list[dict]) -> dict | None:
    """The best row (`{"settings", "makespan_s", "hit_rate", "failed"}`) by the module's rule."""
    if not rows:
        return None
    clean = [r for r in rows if r["failed"] == 0]
    pool = clean or rows
    best = min(pool, key=lambda r: (r["failed"], r["makespan_s"], -r["hit_rate"]))
    return {**best, "all_failed_some_turn": not clean}


def format_sweep(mode: str, rows: list[dict], baseline_makespan: float | None) -> str:
    lines = [
        f"sweep {mode}:",
        f"  {'high_wm':>8}{'hit_thr':>8}{'grace':>7}{'headroom':>9}{'hit':>7}{'makespan':>10}"
        f"{'x sticky':>9}{'failed':>7}",
    ]
    for r in rows:
        k = r["settings"]
        ratio = r["makespan_s"] / baseline_makespan if baseline_makespan else None
        lines.append(
            f"  {k.get('high_watermark', '-'):>8}{k.get('hit_threshold', '-'):>8}"
            f"{k.get('idle_grace_sec', '-'):>7}{k.get('headroom_blocks', '-'):>9}"
            f"{r['hit_rate']:>7.3f}{r['makespan_s']:>9.1f}s"
            f"{'-' if ratio is None else format(ratio, '.2f'):>9}{r['failed']:>7}"
        )
    best = best_point(rows)
    if best:
        flag = " (every point failed a turn)" if best["all_failed_some_turn"] else ""
        lines.append(
            f"  best for {mode}: {best['settings']} -> makespan {best['makespan_s']:.1f}s, "
            f"hit rate {best['hit_rate']:.3f}{flag}"
        )
    return "\n".join(lines)
