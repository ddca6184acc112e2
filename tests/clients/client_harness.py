"""Real agent clients for the client tests: each installed once into its own venv under
the kvgate cache (`KVGATE_CACHE_DIR`, default ~/.cache/kvgate/clients/), as the vLLM
tests install vLLM; kvgate's access log read back as records; the environment that
keeps a client off the network."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_plugin"))
from vllm_harness import CACHE_ROOT, file_lock  # noqa: E402  (the vLLM tests' cache and lock)

CLIENTS_DIR = CACHE_ROOT / "clients"
# The marks of a test of an npm client (Claude Code, Codex CLI).
NPM_CLIENT = [
    pytest.mark.clients,
    pytest.mark.skipif(shutil.which("npm") is None, reason="npm is needed to install the client"),
]
# One turn each at least (more when the reply calls a tool): five prompts make five turns.
PROMPTS = (
    "list the files here",
    "read README.md and summarise it",
    "which file is the entry point?",
    "what does main.py print?",
    "summarise what you found",
)

SENTINEL_NAME = ".kvgate-client-complete"

# Every client talks to kvgate on loopback only: any other connection goes to a proxy on
# the discard port, which refuses it; the clients' telemetry is off as well.
NO_NETWORK_ENV = {
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "ALL_PROXY": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
}


def ensure_python_client(pip_spec: str) -> Path:
    """The python of a venv holding `pip_spec` (e.g. "openai-agents==0.24.0"), created once
    under CLIENTS_DIR (under a lock; complete once its sentinel is written)."""
    venv = CLIENTS_DIR / pip_spec.replace("==", "-")
    python = venv / "bin" / "python"
    with file_lock(CLIENTS_DIR / f"{venv.name}.lock"):
        if (venv / SENTINEL_NAME).exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        for command, what in (
            ([sys.executable, "-m", "venv", str(venv)], "creating the venv"),
            # --no-compile: byte-compiling all of litellm and the rest took a third of the install
            # (mini-swe-agent: 39 s with it, 26 s without); the client compiles what it imports.
            ([str(python), "-m", "pip", "install", "-q", "--no-compile", pip_spec], f"pip install {pip_spec}"),
        ):
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                raise RuntimeError(f"{what} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        (venv / SENTINEL_NAME).write_text(pip_spec + "\n")
    return python


def access_records(log_text: str) -> list[dict[str, str]]:
    """The access-log lines (proxy/access_log.py) of a `kvgate serve` log, as field -> value."""
    records = []
    for line in log_text.splitlines():
        if line.startswith("time=") and " route=" in line:
            records.append(dict(field.split("=", 1) for field in line.split()))
    return records


def session_turns(records: list[dict[str, str]], route: str) -> dict[str, list[dict[str, str]]]:
    """The generation turns of `route`, by session hash, in log order ("-": anonymous)."""
    turns: dict[str, list[dict[str, str]]] = {}
    for record in records:
        if record["route"] == route:
            turns.setdefault(record["session"], []).append(record)
    return turns


def ensure_npm_client(package: str, version: str, binary: str) -> Path:
    """The executable `binary` of npm `package`@`version`, installed once under
    CLIENTS_DIR (under a lock; complete once its sentinel is written)."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is needed to install the agent client; install Node.js 18 or later")
    prefix = CLIENTS_DIR / f"{package.rsplit('/', 1)[-1]}-{version}"
    executable = prefix / "node_modules" / ".bin" / binary
    with file_lock(CLIENTS_DIR / f"{prefix.name}.lock"):
        if (prefix / SENTINEL_NAME).exists():
            return executable
        shutil.rmtree(prefix, ignore_errors=True)
        command = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", f"{package}@{version}"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if result.returncode != 0 or not executable.exists():
            raise RuntimeError(
                f"npm install {package}@{version} failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
            )
        (prefix / SENTINEL_NAME).write_text(f"{package}@{version}\n")
    return executable


async def run_client(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    """Run one client command to its end; its stdout. A run that fails or outlasts
    `timeout` fails the test with the end of both outputs (the process is killed)."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, (command[:3], out.decode()[-2000:], err.decode()[-2000:])
    return out.decode()


def client_env(drop_prefixes: tuple[str, ...], **overrides: str) -> dict[str, str]:
    """This process's environment without the client's own variables (`drop_prefixes`),
    kept off the network (NO_NETWORK_ENV), with `overrides`."""
    kept = {key: value for key, value in os.environ.items() if not key.startswith(drop_prefixes)}
    return {**kept, **NO_NETWORK_ENV, **overrides}


def assert_session_turns(session_records: list[dict[str, str]], at_least: int) -> None:
    """One session's turns in the access log: at least `at_least`, all on one replica, the
    first opening a window (`window_fits`) and every later one holding it (`holds_window`),
    but for at most one that opens it again: a reply that called no tool ended the window
    (`session.finish_on_final_reply`), and the session came back before the window would
    have gone quiet, so such replies end its windows no more (docs/gate.md)."""
    assert len(session_records) >= at_least, session_records
    assert len({record["replica"] for record in session_records}) == 1, session_records
    admissions = [record["admission"] for record in session_records]
    assert admissions[0] == "window_fits" and set(admissions[1:]) <= {"holds_window", "window_fits"}, admissions
    assert admissions[1:].count("window_fits") <= 1 and "holds_window" in admissions, admissions


ADMIN_TOKEN = "clients-admin"  # the admin API's token of the clients' kvgate (conftest.py)


async def admin_state(url: str) -> dict:
    """kvgate's GET /admin/state."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(url + "/admin/state", headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


async def gate_sessions(url: str) -> tuple[dict[str, int], dict[str, dict]]:
    """kvgate's window ends by cause, summed over its replicas' gates, and every gate's sessions."""
    gates = (await admin_state(url))["gates"].values()
    ends: dict[str, int] = {}
    for gate in gates:
        for cause, count in gate["window_ends"].items():
            ends[cause] = ends.get(cause, 0) + count
    return ends, {key: session for gate in gates for key, session in gate["sessions"].items()}


def assert_all_ok(records: list[dict[str, str]]) -> None:
    assert all(record["status"] == "200" for record in records), [r for r in records if r["status"] != "200"]


def assert_one_session_of_prompts(records: list[dict[str, str]], route: str, prompts: int) -> list[dict[str, str]]:
    """The access log of one conversation of `prompts` CLI runs (each a new process that
    resumed it): one session, no anonymous turn, its turns as `assert_session_turns` says
    with at least one per prompt, its side requests as `assert_side_routes` says, and
    every answer 200. Returns its turns."""
    turns = session_turns(records, route)
    assert "-" not in turns, "an anonymous turn"
    ((_, session_records),) = turns.items()
    assert_session_turns(session_records, prompts)
    assert_side_routes(records, route, session_records)
    assert_all_ok(records)
    return session_records


def assert_side_routes(records: list[dict[str, str]], route: str, session_records: list[dict[str, str]]) -> None:
    """Every access line is a turn of `route`, a model list (`models`), or a side request
    kvgate forwarded ungated (`passthrough`: count_tokens and the like) in the session,
    to the replica of its turns. Prints how many side requests the client sent."""
    (session,) = {record["session"] for record in session_records}
    (replica,) = {record["replica"] for record in session_records}
    side = [record for record in records if record["route"] != route]
    assert all(record["route"] in ("passthrough", "models") for record in side), side
    passthrough = [record for record in side if record["route"] == "passthrough"]
    assert all(record["session"] == session and record["replica"] == replica for record in passthrough), side
    print(f"side requests through kvgate: {len(side)} ({len(passthrough)} passthrough)")


def assert_every_request_forwarded(requests: list, records: list[dict[str, str]]) -> None:
    """Every request the client sent (request_recorder.Request) was answered under 400
    and forwarded: one access line each, so kvgate refused none before forwarding."""
    assert all(request.status < 400 for request in requests), [r for r in requests if r.status >= 400]
    assert len(requests) == len(records), (requests, records)
    print(f"client requests: {sorted({(request.method, request.path) for request in requests})}")


def task_folder(root: Path) -> Path:
    """The files a client's read-only tools see: its whole world."""
    root.mkdir()
    (root / "README.md").write_text("# demo\nA tiny project: main.py prints a greeting.\n")
    (root / "main.py").write_text("print('hello')\n")
    return root
