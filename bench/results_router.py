"""The results page's router row: `kvgate bench overhead --router-command`, kvgate's
throughput against a direct connection beside vllm-router's, in the same run, judged
against its target (kvgate at least vllm-router's share of direct).

`kvgate bench results --only router` runs it (every run without `--only` too; with no
`vllm-router` on PATH the row is left as it was). The row is stored with the others in
docs/results.json (kind `router`) and rendered in a section of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvgate.bench.results_overhead import run_row as run_overhead_row
from kvgate.bench.results_overhead import section_head

KEY = "router"
ROUTER = "vllm-router --host 127.0.0.1 --port {port} --worker-urls {upstream} --policy consistent_hash"
OPTIONS = (
    "--concurrency",
    "64",
    "--modes",
    "non-streaming",
    "--duration",
    "5",
    "--repeats",
    "3",
    "--router-command",
    ROUTER,
)
LIMIT = (
    "kvgate's one Python process: it serves every request on one core's event loop, "
    "where vllm-router (Rust, one worker thread per core) serves on every core the machine has; the "
    "gate's share is in the CPU-per-request row above"
)


def record(document: dict, command: str, date: str, commit: str) -> dict:
    """The stored row of one `kvgate bench overhead --router-command` run (its --out JSON)."""
    cases = []
    for r in document["results"]:
        direct, kvgate, router = r["direct"]["rps"], r["proxied"]["rps"], r["baseline"]["rps"]
        cases.append(
            {
                "mode": r["mode"],
                "concurrency": r["concurrency"],
                "direct_rps": direct,
                "kvgate_rps": kvgate,
                "router_rps": router,
                "kvgate_share": kvgate / direct if direct else None,
                "router_share": router / direct if direct else None,
                "errors": sum(r[target]["errors"] for target in ("direct", "proxied", "baseline")),
            }
        )
    return {"key": KEY, "kind": "router", "command": command, "date": date, "commit": commit, "cases": cases}


def judged(case: dict) -> str:
    """kvgate's share of direct throughput against vllm-router's, met or missed."""
    kvgate, router = case["kvgate_share"], case["router_share"]
    if kvgate is None or router is None:
        return ">= vllm-router's: no figure **missed**"
    return f">= vllm-router's: {kvgate:.2f} vs {router:.2f} **{'met' if kvgate >= router else 'missed'}**"


def render(records: list[dict]) -> list[str]:
    """The router section of the page from its stored row."""
    lines: list[str] = []
    for r in records:
        lines += section_head(
            "Throughput beside vllm-router (`kvgate bench overhead --router-command`)",
            [
                "The same fast upstream, answered directly, through kvgate (gate on, a calm replica) and",
                "through vllm-router, closed loop, runs alternating; each one's requests/s and its share",
                "of direct (median of the runs). Details: [proxy.md](proxy.md#overhead-benchmark).",
            ],
            r,
            [
                "mode",
                "clients",
                "direct req/s",
                "kvgate req/s (share)",
                "vllm-router req/s (share)",
                "target",
                "errors",
            ],
        )
        missed = False
        for case in r["cases"]:
            verdict = judged(case)
            missed |= "missed" in verdict
            lines.append(
                f"| {case['mode']} | {case['concurrency']} | {case['direct_rps']:.0f} "
                f"| {case['kvgate_rps']:.0f} ({_share(case['kvgate_share'])}) "
                f"| {case['router_rps']:.0f} ({_share(case['router_share'])}) | {verdict} | {case['errors']} |"
            )
        if missed:
            lines += ["", f"Limited by {LIMIT}."]
    return lines


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def run_row(store: Callable[[dict], None], commit: str, cwd: Path | None = None) -> bool:
    """Run the row's command (`OPTIONS`) and `store` its row; False (row not updated) if it failed."""
    return run_overhead_row(store, commit, OPTIONS, cwd, record, KEY)
