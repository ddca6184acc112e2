"""The results page's overhead rows: `kvgate bench overhead --sessions`, the gate's CPU per
request as the sessions it books grow, judged against its targets (`CPU_TARGETS`), with
requests of one short message (`KEY`) and with an agent's history in each (`AGENT_KEY`).

`kvgate bench results --only overhead` (`--only overhead-agent`) runs one (every run
without `--only` both); the rows are stored with the others in docs/results.json (kind
`overhead`) and rendered in sections of their own.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

KEY = "overhead"
OPTIONS = ("--sessions", "100,1000,10000", "--duration", "3", "--repeats", "3", "--session-rate", "2000")
# The same with each request carrying an agent's history of AGENT_BODY_KIB (a coding agent's
# turn of about 30k tokens), where the proxy's own cost grows with the body and the gate's must not.
AGENT_KEY = "overhead-agent"
AGENT_BODY_KIB = 128
AGENT_OPTIONS = ("--sessions", "100,10000", "--body-kib", str(AGENT_BODY_KIB), "--duration", "3", "--repeats", "3")
ROWS = ((KEY, OPTIONS), (AGENT_KEY, AGENT_OPTIONS))  # each row's key and `kvgate bench overhead` options
# Gate on over gate off, CPU per request, at most this at N sessions: a gate that costs little
# more than the proxy without it, whatever the sessions it books.
CPU_TARGETS = {100: 1.3, 10_000: 1.5}
LIMIT = (
    "the gate's bookkeeping per turn, in Python: with nothing to hold, a turn is admitted by the "
    "policy's calm rule on a few O(1) facts and booked with its admission in one step, but the "
    "session's record still changes at its admission, its usage (the window repriced, the holding "
    "shares measured) and its release, with the lease and one admission histogram: "
    "about 25 µs of CPU per turn in `gate/` alone on a warm cache, and about twice that inside the "
    "proxy (a py-spy profile of the gate-on kvgate); and what a gate on adds to the proxy's own "
    "path (the usage read from each answer, the admission headers). At 10,000 sessions, windows "
    "also end and open again as sessions go quiet between their turns"
)


def record(document: dict, command: str, date: str, commit: str) -> dict:
    """The stored row of one `kvgate bench overhead --sessions` run (its --out JSON): per
    size, the closed-loop figures and, when measured (`--session-rate`), the paced ones."""
    rows = []
    for r in document["sessions"]:
        row = {"sessions": r["sessions"], "windows": r["windows"], **_figures(r)}
        if "paced" in r:
            row["paced"] = {"rate": r["paced"]["rate"], **_figures(r["paced"])}
        rows.append(row)
    body_kib = document.get("body_kib", 0)
    return {
        "key": AGENT_KEY if body_kib else KEY,
        "kind": "overhead",
        "command": command,
        "date": date,
        "commit": commit,
        "body_kib": body_kib,
        "sessions": rows,
    }


def _figures(part: dict) -> dict:
    return {
        "off_us": part["off"]["cpu_us_per_request"],
        "on_us": part["on"]["cpu_us_per_request"],
        "ratio": part["cpu_ratio"],
        "errors": part["off"]["errors"] + part["on"]["errors"],
    }


def judged(ratio: float | None, sessions: int) -> str:
    """A ratio against the target at `sessions`, met or missed, or '-' for a size without one."""
    target = CPU_TARGETS.get(sessions)
    if target is None:
        return "-"
    if ratio is None:
        return f"<= {target}x: no figure **missed**"
    return f"<= {target}x: {ratio:.2f}x **{'met' if ratio <= target else 'missed'}**"


def render(records: list[dict]) -> list[str]:
    """The overhead section of the page from its stored row: a line per size and load
    (closed loop; paced, when measured), each judged against the size's target."""
    lines: list[str] = []
    for r in sorted(records, key=lambda r: r.get("body_kib", 0)):
        body_kib = r.get("body_kib", 0)
        title = "The gate's CPU per request as its sessions grow (`kvgate bench overhead --sessions`)"
        body = ["request with one short message."]
        if body_kib:
            title = f"The same with an agent's {body_kib} KiB history in every request (`--body-kib {body_kib}`)"
            body = [
                f"request carrying {body_kib} KiB of tool calls and their results, as a coding agent's turn",
                "does: the proxy reads the whole body, and the gate must not read it again.",
            ]
        lines += section_head(
            title,
            [
                "kvgate in front of a fast upstream that answers the probe API as a calm replica, with the",
                "gate off and on, each request's session taken in turn from N; CPU per request is the",
                "kvgate process's (median of the runs), closed loop (each kvgate as fast as it answers) and,",
                "where measured, paced (both kvgates serving the same requests per second); each",
                *body,
                "Details: [proxy.md](proxy.md#overhead-benchmark).",
            ],
            r,
            ["sessions", "windows", "load", "gate off µs/req", "gate on µs/req", "on / off", "target", "errors"],
        )
        missed = False
        for row in r["sessions"]:
            windows = "-" if row["windows"] is None else str(row["windows"])
            loads = [("closed loop", row)] + (
                [(f"{row['paced']['rate']:g} req/s", row["paced"])] if "paced" in row else []
            )
            for load, part in loads:
                verdict = judged(part["ratio"], row["sessions"])
                missed |= "missed" in verdict
                ratio = "-" if part["ratio"] is None else f"{part['ratio']:.2f}x"
                lines.append(
                    f"| {row['sessions']} | {windows} | {load} | {_us(part['off_us'])} | {_us(part['on_us'])} "
                    f"| {ratio} | {verdict} | {part['errors']} |"
                )
        if missed:
            lines += ["", f"Limited by {LIMIT}."]
    return lines


def section_head(title: str, intro: list[str], stored: dict, columns: list[str]) -> list[str]:
    """The lines of a benchmark's section up to its table's rows: its title, what it
    measures, the command that measured it (with date and commit), the table's header."""
    return [
        "",
        f"## {title}",
        "",
        *intro,
        "",
        f"`{stored['command']}` ({stored['date']}, {stored['commit']})",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def run_row(
    store: Callable[[dict], None],
    commit: str,
    options: tuple[str, ...] = OPTIONS,
    cwd: Path | None = None,
    make_record: Callable[[dict, str, str, str], dict] = record,
    key: str = KEY,
) -> bool:
    """Run `kvgate bench overhead` with `options` and `store` its row (`make_record` of its
    --out document, command, date and commit); False (row not updated) if it failed."""
    shown = shlex.join(["kvgate", "bench", "overhead", *options])
    command = [sys.executable, "-m", "kvgate.cli", "bench", "overhead", *options]
    return run_command_row(shown, command, make_record, key, store, commit, cwd)


def run_command_row(
    shown: str,
    command: list[str],
    make_record: Callable[[dict, str, str, str], dict],
    key: str,
    store: Callable[[dict], None],
    commit: str,
    cwd: Path | None = None,
) -> bool:
    """Run `command` with `--out FILE` added (a scratch JSON file) and `store` the row
    `make_record` makes of that document, `shown` (the command as a user types it), the
    date and `commit`; False (row not updated) if it failed or wrote no document."""
    print(f"[results] {shown}", flush=True)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    with tempfile.TemporaryDirectory(prefix="kvgate-results-") as scratch:
        out = Path(scratch) / f"{key}.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        status = subprocess.run([*command, "--out", str(out)], cwd=cwd, env=env).returncode
        if status != 0 or not out.exists():
            print(f"[results] {key}: exit {status}, row not updated", file=sys.stderr)
            return False
        store(make_record(json.loads(out.read_text()), shown, date, commit))
    return True
