"""`kvgate top` against a live `kvgate serve` (simulated replicas, loopback), read from its output."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from kvgate.cli.top import render
from kvgate.proxy.access_log import session_hash
from tests.proxy.serve_process import start_until_listening, stop_serve
from tests.ui.stack import turn

TOKEN = "top-test-token"


@pytest.fixture
async def serve():
    # windows that outlive the test: top lists the sessions holding one
    env = {
        **os.environ,
        "KVGATE_ADMIN__TOKEN": TOKEN,
        "KVGATE_GATE__IDLE_GRACE_SEC": "600",
        "KVGATE_GATE__QUIET_FLOOR_SEC": "600",
    }
    proc, _lines, url = await start_until_listening(
        [sys.executable, "-m", "kvgate.cli", "serve", "--port", "0"], env=env
    )
    yield url
    await stop_serve(proc)


async def top(*args: str, token: str | None = TOKEN, timeout: float = 30) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVGATE_ADMIN__TOKEN"}
    if token is not None:
        env["KVGATE_ADMIN__TOKEN"] = token
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        "top",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out.decode(), err.decode()


async def test_top_once_shows_replicas_and_sessions(serve, tmp_path):
    for status, _ in await asyncio.gather(*(turn(serve, session) for session in ("alpha", "beta", "gamma"))):
        assert status == 200
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    (code, out, err), (file_code, file_out, _) = await asyncio.gather(  # two processes at once
        top("--once", "--url", serve), top("--once", "--url", serve, "--token-file", str(token_file), token=None)
    )
    assert code == 0, err
    assert "\x1b" not in out  # --once prints plain text
    lines = out.splitlines()
    assert "3 sessions tracked" in lines[0] and "0 waiting" in lines[0]
    replica_rows = [line for line in lines if line.startswith(("sim0 ", "sim1 "))]
    assert len(replica_rows) == 2 and all("healthy" in row and "enforce/working_set" in row for row in replica_rows)
    for session in ("alpha", "beta", "gamma"):  # a window each (working_set admits them window_fits)
        (row,) = [line for line in lines if line.startswith(session + " ")]
        assert session_hash(session) in row and "window_fits:1" in row
    assert file_code == 0 and "SESSIONS HOLDING A WINDOW (3)" in file_out


async def test_top_says_what_is_wrong(serve):
    wrong, missing, unreachable = await asyncio.gather(  # three processes at once
        top("--once", "--url", serve, token="wrong"),
        top("--once", "--url", serve, token=None),
        top("--once", "--url", "http://127.0.0.1:9", token=TOKEN),
    )
    code, _, err = wrong
    assert code == 2 and "refused the admin token" in err
    code, _, err = missing
    assert code == 2 and "KVGATE_ADMIN__TOKEN" in err
    code, _, err = unreachable
    assert code == 1 and "cannot read http://127.0.0.1:9/admin/status" in err


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def test_top_redraws_in_place_until_interrupted(serve):
    env = {**os.environ, "KVGATE_ADMIN__TOKEN": TOKEN, "COLUMNS": "120", "LINES": "30"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgate.cli",
        "top",
        "--url",
        serve,
        "--interval",
        "0.3",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # Ctrl-C reaches `kvgate top` from a terminal; a test run started in the background
        # (`nohup pytest &`) ignores SIGINT, which its children would inherit and never stop.
        preexec_fn=_default_sigint,
    )
    seen = b""
    try:
        while seen.count(b"\x1b[H") < 3:  # three frames, each from the top of the screen
            seen += await asyncio.wait_for(proc.stdout.read(4096), 30)
        await turn(serve, "late-arrival")
        while b"late-arrival" not in seen.rsplit(b"\x1b[H", 1)[-1]:
            seen += await asyncio.wait_for(proc.stdout.read(4096), 30)
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0
    assert seen.startswith(b"\x1b[?1049h") and (seen + rest).endswith(b"\x1b[?1049l")  # the screen comes back
    frame = seen.rsplit(b"\x1b[H", 1)[-1].decode()
    assert all(len(line) <= 120 for line in frame.replace("\x1b[K", "").split("\n"))


def test_render_shows_client_text_without_control_characters():
    status = {
        "time": 0.0,
        "role": "standalone",
        "tracked_sessions": 1,
        "replicas": [],
        "waiters": {
            "total": 1,
            "items": [
                {"session": "evil\x1b]0;owned\x07", "log_id": "abc", "replica": "r0", "waited_sec": 1.5, "held": None},
            ],
        },
        "sessions": {"total": 0, "items": []},
    }
    screen = "\n".join(render(status, "http://kvgate", width=80))
    assert "\x1b" not in screen and "\x07" not in screen
    assert "evil?]0;owned?" in screen and "1.5s" in screen
