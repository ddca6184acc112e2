"""Outputs of the admission experiment: metrics.json, timeline_<policy>.csv, the printed
table, and PNG plots (matplotlib, optional: imported lazily, skipped with a message).

Byte-identical for identical inputs: JSON with sorted keys, CSV of integers.
"""

from __future__ import annotations

import csv
from pathlib import Path

import orjson

from kvgate.simulator.experiment import TIMELINE_COLUMNS, PolicyRun


def write_metrics(out_dir: Path, metrics: dict) -> Path:
    path = out_dir / "metrics.json"
    path.write_bytes(orjson.dumps(metrics, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n")
    return path


def write_timeline(out_dir: Path, run: PolicyRun) -> Path:
    path = out_dir / f"timeline_{run.policy}.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(TIMELINE_COLUMNS)
        writer.writerows(run.timeline)
    return path


TABLE_COLUMNS = (
    ("policy", None),
    ("done", "completed"),
    ("rej", "rejected"),
    ("preempt", "preemptions"),
    ("recomp tok", "recomputed_tokens"),
    ("recomp/req", "recomputed_tokens_per_completed_request"),
    ("ttft p50/p95", ("ttft_p50_steps", "ttft_p95_steps")),
    ("e2e p50/p95", ("e2e_p50_steps", "e2e_p95_steps")),
    ("req/step", "throughput_requests_per_step"),
    ("slot util", "sequence_slot_utilisation"),
    ("budget util", "token_budget_utilisation"),
    ("wm viol", "watermark_violation_steps"),
)


def format_table(metrics: dict) -> str:
    """A fixed-width table of the policies' headline numbers (latencies in steps)."""
    rows = [[title for title, _ in TABLE_COLUMNS]]
    for policy, summary in metrics["policies"].items():
        row = []
        for _, key in TABLE_COLUMNS:
            if key is None:
                row.append(policy)
            elif isinstance(key, tuple):
                row.append("/".join(str(summary[k]) for k in key))
            else:
                row.append(str(summary[key]))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    for policy, summary in metrics["policies"].items():
        shadow = summary.get("shadow")
        if shadow:
            lines.append(
                f"shadow: while {policy} scheduled, {shadow['shadow_policy']} disagreed on "
                f"{shadow['disagreements']} of {shadow['decisions']} admission decisions "
                f"({shadow['disagreement_rate']:.1%})"
            )
    return "\n".join(lines)


def write_plots(out_dir: Path, runs: dict[str, PolicyRun], num_blocks: int) -> list[Path] | str:
    """PNG plots of the timelines; returns the paths, or a message if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plots skipped (pip install 'kvgate[plots]')"
    paths = []
    column = {name: index for index, name in enumerate(TIMELINE_COLUMNS)}

    def series(run: PolicyRun, name: str) -> list[int]:
        index = column[name]
        return [row[index] for row in run.timeline]

    for run in runs.values():
        steps = series(run, "step")
        figure, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
        axes[0].plot(steps, series(run, "used_blocks"), label="used blocks", linewidth=0.7)
        axes[0].axhline(num_blocks, color="black", linewidth=0.5, linestyle="--", label="cache size")
        axes[0].set_ylabel("blocks")
        axes[0].legend(loc="upper right")
        axes[1].plot(steps, series(run, "waiting"), label="waiting", linewidth=0.7)
        axes[1].plot(steps, series(run, "running"), label="running", linewidth=0.7)
        axes[1].set_ylabel("requests")
        axes[1].legend(loc="upper right")
        cumulative, total = [], 0
        for value in series(run, "recomputed_tokens"):
            total += value
            cumulative.append(total)
        axes[2].plot(steps, cumulative, label="recomputed tokens (cumulative)", color="tab:red", linewidth=0.9)
        axes[2].set_ylabel("tokens")
        axes[2].set_xlabel("step")
        axes[2].legend(loc="upper left")
        figure.suptitle(f"admission policy: {run.policy}")
        figure.tight_layout()
        path = out_dir / f"timeline_{run.policy}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)

    figure, axis = plt.subplots(figsize=(11, 4))
    for run in runs.values():
        cumulative, total = [], 0
        for value in series(run, "preemptions"):
            total += value
            cumulative.append(total)
        axis.plot(series(run, "step"), cumulative, label=run.policy)
    axis.set_xlabel("step")
    axis.set_ylabel("preemptions (cumulative)")
    axis.legend()
    figure.tight_layout()
    path = out_dir / "preemptions.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    paths.append(path)
    return paths
