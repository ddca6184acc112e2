"""`kvgate top`: the status page's view in a terminal (docs/reference.md, Command line).

It polls a kvgate's `GET /admin/status` (docs/reference.md, Admin API) and redraws in
place: per replica its health, owner record, gate, KV usage beside the gate's books,
windows, leases, waiters and hit rate; the waiting turns; the sessions holding a window.
Plain ANSI (cursor home, erase line, erase below), no library: the screen is one table
redrawn whole. The token comes from KVGATE_ADMIN__TOKEN (the variable that sets the
server's admin.token) or --token-file, never from the command line, where `ps` shows it.

`render(status, ...)` is pure (a snapshot in, lines out); the loop around it does the I/O.
Every text from kvgate goes through `_clean`: session ids are client-chosen and must not
reach the terminal as control sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

TOKEN_ENV = "KVGATE_ADMIN__TOKEN"
_HOME, _ERASE_LINE, _ERASE_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
_ALT_SCREEN_ON, _ALT_SCREEN_OFF = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"


class TopError(Exception):
    """kvgate could not be read; the message says what to do. `code` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def add_command(subparsers) -> None:
    top = subparsers.add_parser(
        "top",
        help="watch a running kvgate in the terminal",
        description="Show a running kvgate's replicas, waiting turns and sessions (its GET /admin/status), "
        f"refreshed in place. The admin token comes from {TOKEN_ENV} or --token-file.",
    )
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the kvgate's base URL (default %(default)s)")
    top.add_argument("--token-file", metavar="FILE", help=f"file holding admin.token (default: ${TOKEN_ENV})")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default %(default)s)")
    top.add_argument("--once", action="store_true", help="print one snapshot and exit (no escape sequences)")
    top.set_defaults(func=top_command)


def read_token(token_file: str | None) -> str:
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise TopError(f"cannot read --token-file {token_file}: {exc.strerror}", 2) from exc
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise TopError(f"kvgate top needs the admin token: set {TOKEN_ENV} or pass --token-file FILE", 2)
    return token


def fetch_status(url: str, token: str, limit: int, timeout: float = 5.0) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url.rstrip('/')}/admin/status?view=windows&limit={limit}", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise TopError(f"{url} refused the admin token (401): check {TOKEN_ENV} or --token-file", 2) from exc
        if exc.code == 404:
            raise TopError(f"{url} has no admin API (404): set admin.token on that kvgate", 2) from exc
        raise TopError(f"{url} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TopError(f"cannot read {url}/admin/status: {reason}") from exc


def top_command(args: argparse.Namespace) -> int:
    try:
        token = read_token(args.token_file)
        if args.once:  # for a script or a ticket: whole lines, unless a terminal would wrap them
            width = shutil.get_terminal_size().columns if sys.stdout.isatty() else 10_000
            print("\n".join(render(fetch_status(args.url, token, 50), args.url, width, 10_000)))
            return 0
    except TopError as exc:
        print(f"kvgate top: {exc}", file=sys.stderr)
        return exc.code
    return _watch(args.url, token, max(0.2, args.interval))


def _watch(url: str, token: str, interval: float) -> int:
    """Redraw every `interval` seconds until Ctrl-C (exit 0) or a refused token (exit 2);
    an unreachable kvgate is shown and retried (it may be restarting)."""
    out = sys.stdout
    out.write(_ALT_SCREEN_ON)
    failure: TopError | None = None
    try:
        while True:
            size = shutil.get_terminal_size((120, 40))
            try:
                lines = render(fetch_status(url, token, max(5, size.lines)), url, size.columns, size.lines)
            except TopError as exc:
                if exc.code == 2:
                    raise
                lines = [_fit(f"kvgate top: {exc}; retrying every {interval:g} s", size.columns)]
            out.write(_HOME + "".join(line + _ERASE_LINE + "\n" for line in lines[:-1]) + lines[-1] + _ERASE_BELOW)
            out.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    except TopError as exc:
        failure = exc
    finally:
        out.write(_ALT_SCREEN_OFF)
        out.flush()
    if failure is not None:
        print(f"kvgate top: {failure}", file=sys.stderr)
        return failure.code
    return 0


# ---- rendering (pure) ----------------------------------------------------------------


def _clean(value: object) -> str:
    """`value` as text with every control character (escape sequences included) shown as '?'."""
    return "".join("?" if ord(c) < 32 or 127 <= ord(c) < 160 else c for c in str(value))


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[: max(1, width - 1)] + "…"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else str(round(x))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _replica_row(r: dict[str, Any]) -> list[str]:
    gate, usage, owner = r.get("gate"), r.get("usage"), r.get("owner")
    health = "draining" if r["draining"] else "healthy" if r["healthy"] else "UNHEALTHY"
    if usage is None:
        kv = "-"
    elif usage.get("num_total_blocks") is None:
        kv = _pct(usage["kv_cache_usage"])
    else:
        kv = f"{usage['used_blocks']}/{usage['num_total_blocks']} ({_pct(usage['kv_cache_usage'])})"
    owned = "-" if owner is None else owner["status"] + (f"+{owner['contenders']}" if owner["contenders"] else "")
    return [
        _clean(r["name"]),
        health,
        _clean(owned),
        "-" if gate is None else _clean(f"{gate['mode']}/{gate['policy']}"),
        kv,
        "-" if gate is None else str(gate["window_blocks"]),
        "-" if gate is None else f"{gate['windows_in_flight']}/{gate['windows_idle']}",
        "-" if gate is None else str(gate["leases"]),
        "-" if gate is None else str(gate["waiters"]),
        f"{_num(r.get('running'))}/{_num(r.get('waiting'))}",
        _pct(r.get("hit_rate_1m")),
    ]


def _session_state(s: dict[str, Any]) -> str:
    if s.get("held"):
        return "waiting: " + _clean(s["held"]["cause"])
    if s["in_flight"]:
        return "in flight"
    return "idle, window" if s["has_window"] else "idle"


def render(status: dict[str, Any], url: str, width: int = 160, height: int = 10_000) -> list[str]:
    """The screen for one `/admin/status` snapshot: at most `height` lines of at most `width` characters."""
    waiters, sessions = status["waiters"], status["sessions"]
    clock = datetime.fromtimestamp(status["time"]).strftime("%H:%M:%S")
    lines = [
        f"kvgate top · {_clean(url)} · {_clean(status['role'])} · {status['tracked_sessions']} sessions tracked"
        f" · {waiters['total']} waiting · {clock}",
        "",
        *_table(
            [
                "REPLICA",
                "HEALTH",
                "OWNER",
                "GATE",
                "KV USED",
                "BOOKS",
                "WIN F/I",
                "LEASES",
                "WAIT",
                "RUN/WAIT",
                "HIT 1m",
            ],
            [_replica_row(r) for r in status["replicas"]],
        ),
        "",
        f"WAITING TURNS ({waiters['total']})",
    ]
    room = max(1, (height - len(lines) - 4) // 2)
    rows = [
        [
            "(anonymous)" if w["session"] is None else _clean(w["session"]),
            w["log_id"] or "-",
            _clean(w["replica"]),
            f"{w['waited_sec']:.1f}s",
            "deciding" if w["held"] is None else _clean(w["held"]["cause"]),
        ]
        for w in waiters["items"][:room]
    ]
    lines += _table(["SESSION", "LOG ID", "REPLICA", "WAITED", "WHY"], rows) if rows else ["  none"]
    lines += ["", f"SESSIONS HOLDING A WINDOW ({sessions['total']})"]
    rows = [
        [
            _clean(s["session"]),
            s["log_id"],
            _clean(s["replica"]),
            _session_state(s),
            str(s["resident_blocks"]) if s["has_window"] else "-",
            "-" if s["idle_sec"] is None else f"{s['idle_sec']:.1f}s",
            _clean(" ".join(f"{k}:{n}" for k, n in s["reasons"].items())),
        ]
        for s in sessions["items"][: max(1, height - len(lines) - 1)]
    ]
    lines += (
        _table(["SESSION", "LOG ID", "REPLICA", "STATE", "BLOCKS", "IDLE", "ADMISSIONS"], rows) if rows else ["  none"]
    )
    return [_fit(line, width) for line in lines[:height]]
