"""The results page's KV-pins row: a pinned window through a flood on real vLLM CPU
(tests/vllm_plugin/scripts/run_pin_flood.py), judged against its target: the pinned
window hits whole and the unpinned one (vLLM's own LRU eviction) about not at all, with
no preemption.

`kvgate bench results --vllm` runs it (`--vllm --only pins` alone: it starts a vLLM CPU
server with the plugin's retention connector). The row is stored with the others in
docs/results.json (kind `pins`) and rendered in a section of its own.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from kvgate.bench.results_overhead import run_command_row

KEY = "pins"
RUNNER = "tests/vllm_plugin/scripts/run_pin_flood.py"
# The target: a pinned window survives the flood whole; an unpinned one (what vLLM keeps
# without the connector) keeps at most this share of its blocks.
PINNED_HIT = 1.0
UNPINNED_HIT_AT_MOST = 0.1


def record(document: dict, command: str, date: str, commit: str) -> dict:
    """The stored row of one run_pin_flood.py run (its --out JSON)."""
    return {"key": KEY, "kind": "pins", "command": command, "date": date, "commit": commit, **document}


def judged(r: dict) -> str:
    """The target, met or missed, with the figures."""
    met = r["pinned_hit"] >= PINNED_HIT and r["unpinned_hit"] <= UNPINNED_HIT_AT_MOST and r["preemptions"] == 0
    return (
        f"pinned hit {PINNED_HIT:.1f}, unpinned <= {UNPINNED_HIT_AT_MOST:.1f}, no preemption: "
        f"{r['pinned_hit']:.2f} / {r['unpinned_hit']:.2f} / {r['preemptions']} **{'met' if met else 'missed'}**"
    )


def render(records: list[dict]) -> list[str]:
    """The KV-pins section of the page from its stored row."""
    lines: list[str] = []
    for r in records:
        lines += [
            "",
            "## A pinned window through a flood (real vLLM CPU, the retention connector)",
            "",
            "One session's window sent pinned (the gate's pin, proved with the replica key), another's",
            "unpinned; then other sessions' prompts through the cache three times over, and the prefix",
            "probe reads how much of each window is still resident. The unpinned window is what vLLM",
            "keeps without the connector. Details: [vllm-plugin.md](vllm-plugin.md#kv-pins-the-retention-connector).",
            "",
            f"`{r['command']}` ({r['date']}, {r['commit']})",
            "",
            "| server | window blocks | flood | pinned hit | unpinned hit | preemptions | target |",
            "|---|---|---|---|---|---|---|",
            f"| {r['server']} | {r['window_blocks']} | {r['flood_turns']} x {r['flood_blocks']} blocks "
            f"| {r['pinned_hit']:.2f} | {r['unpinned_hit']:.2f} | {r['preemptions']} | {judged(r)} |",
        ]
    return lines


def run_row(store: Callable[[dict], None], commit: str, cwd: Path | None = None, runner: str = RUNNER) -> bool:
    """Run `runner` (a path under `cwd`) and `store` its row; False (row not updated) if it failed."""
    shown = shlex.join(["python", runner])
    return run_command_row(shown, [sys.executable, runner], record, KEY, store, commit, cwd)
