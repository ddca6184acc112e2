"""PNG plots of a cluster run: KV usage, gate waiters, hit rate and evictions over time per
policy (failure events marked), and the replica sweep.

matplotlib is the optional `plots` extra, imported lazily: without it the plots are
skipped with a message. Small figures (about 100 dpi) so the docs can commit them.
"""

from __future__ import annotations

from pathlib import Path

from kvgate.bench.agentic.plots import windowed_hit_rate


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[cluster] matplotlib is not installed: skipping plots (pip install 'kvgate[plots]')")
        return None
    return plt


def _rate(timeline: list[dict], key: str) -> list[tuple[float, float]]:
    """(t, per-second increase of the cumulative `key` over the interval ending at t)."""
    points = []
    for before, after in zip(timeline, timeline[1:]):
        span = after["t"] - before["t"]
        if span > 0:
            points.append((after["t"], (after[key] - before[key]) / span))
    return points


def write_timeline_plot(
    timelines: dict[str, list[dict]], events: list[tuple[float, str]], path: Path, title: str
) -> bool:
    """Four panels over time, one line per policy: KV usage (mean over replicas), gate
    waiters, windowed hit rate, evictions per second; events as vertical lines."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(4, 1, figsize=(8, 8.5), sharex=True)
    panels = (
        ("KV usage (mean of replicas)", lambda tl: [(s["t"], s["kv_usage_mean"]) for s in tl]),
        ("turns waiting at the gates", lambda tl: [(s["t"], s["gate_waiters"]) for s in tl]),
        ("prefix-cache hit rate", windowed_hit_rate),
        ("evictions / s (blocks)", lambda tl: _rate(tl, "evictions")),
    )
    for ax, (label, series) in zip(axes, panels):
        for policy, timeline in timelines.items():
            points = series(timeline)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=policy, linewidth=1)
        for at, _ in events:
            ax.axvline(at, color="red", linestyle="--", linewidth=0.8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    for at, what in events:
        axes[0].annotate(what, (at, 1.0), xycoords=("data", "axes fraction"), fontsize=7, color="red", va="bottom")
    axes[0].legend(fontsize=7, loc="lower right")
    axes[-1].set_xlabel("virtual seconds")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72, metadata={"Software": None})
    plt.close(fig)
    return True


def write_sweep_plot(sweep: dict[int, dict[str, dict]], p95_target_s: float | None, path: Path, title: str) -> bool:
    """Turn-latency p95 (dotted: of the later turns, each session's first left out) and hit
    rate against the replica count, one line per policy."""
    plt = _pyplot()
    if plt is None:
        return False
    policies = sorted({policy for results in sweep.values() for policy in results})
    counts = sorted(sweep)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for policy in policies:
        xs = [n for n in counts if policy in sweep[n]]
        (line,) = top.plot(xs, [sweep[n][policy]["turn_latency_s"]["p95"] for n in xs], marker="o", label=policy)
        later = [n for n in xs if (sweep[n][policy].get("later_turn_latency_s") or {}).get("p95") is not None]
        if later:
            top.plot(
                later,
                [sweep[n][policy]["later_turn_latency_s"]["p95"] for n in later],
                linestyle=":",
                color=line.get_color(),
                label=f"{policy}, later turns",
            )
        bottom.plot(xs, [sweep[n][policy]["hit_rate"] for n in xs], marker="o", label=policy)
    if p95_target_s is not None:
        top.axhline(p95_target_s, color="red", linestyle="--", linewidth=0.8, label=f"target {p95_target_s:g} s")
    top.set_ylabel("turn latency p95 (s)")
    top.set_yscale("log")
    bottom.set_ylabel("prefix-cache hit rate")
    bottom.set_xlabel("replicas")
    bottom.set_xticks(counts)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72, metadata={"Software": None})
    plt.close(fig)
    return True
