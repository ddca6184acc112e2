"""PNG plots of a run: hit rate over time per mode, and turn latency by turn index.

matplotlib is the optional `plots` extra: it is imported only here, lazily, and a
missing matplotlib skips the plots with a message instead of failing the run.
"""

from __future__ import annotations

from pathlib import Path


def windowed_hit_rate(timeline: list[dict]) -> list[tuple[float, float]]:
    """(t, hit rate within the interval ending at t) from cumulative samples; empty intervals skipped."""
    points = []
    prev_q = prev_h = 0.0
    for sample in timeline:
        dq = sample["queries"] - prev_q
        if dq > 0:
            points.append((sample["t"], (sample["hits"] - prev_h) / dq))
        prev_q, prev_h = sample["queries"], sample["hits"]
    return points


def write_plots(results: dict, timelines: dict[str, list[dict]], out_dir: Path) -> list[str]:
    """Write the PNGs into `out_dir`; return their names (empty, with a printed reason, without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[agentic] matplotlib is not installed: skipping plots (pip install 'kvgate[plots]')")
        return []
    written = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, timeline in timelines.items():
        points = windowed_hit_rate(timeline)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=mode)
    ceiling = next((summary.get("ceiling_hit_rate") for summary in results.values()), None)  # the first mode's
    if ceiling:
        ax.axhline(ceiling, color="grey", linestyle="--", label="ceiling (infinite cache)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("prefix-cache hit rate (per interval)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.set_title("Prefix-cache hit rate over time")
    fig.tight_layout()
    fig.savefig(out_dir / "hit_rate_over_time.png", dpi=110)
    plt.close(fig)
    written.append("hit_rate_over_time.png")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, r in results.items():
        by_turn = r.get("turn_latency_mean_s_by_turn", {})
        if by_turn:
            turns = sorted(int(k) for k in by_turn)
            ax.plot(turns, [by_turn[str(t)] for t in turns], marker="o", label=mode)
    ax.set_xlabel("turn index in session")
    ax.set_ylabel("mean turn latency (s)")
    ax.legend()
    ax.set_title("Turn latency by turn index")
    fig.tight_layout()
    fig.savefig(out_dir / "turn_latency_by_turn.png", dpi=110)
    plt.close(fig)
    written.append("turn_latency_by_turn.png")
    return written
