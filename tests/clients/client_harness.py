"""Real agent clients for the client tests: each installed once into its own venv under
the kvgate cache (`KVGATE_CACHE_DIR`, default ~/.cache/kvgate/clients/), as the vLLM
tests install vLLM; kvgate's access log read back as records; the environment that
keeps a client off the network."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

CACHE_ROOT = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))
CLIENTS_DIR = CACHE_ROOT / "clients"
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


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_python_client(pip_spec: str) -> Path:
    """The python of a venv holding `pip_spec` (e.g. "openai-agents==0.24.0"), created once
    under CLIENTS_DIR (under a lock; complete once its sentinel is written)."""
    venv = CLIENTS_DIR / pip_spec.replace("==", "-")
    python = venv / "bin" / "python"
    with _locked(CLIENTS_DIR / f"{venv.name}.lock"):
        if (venv / SENTINEL_NAME).exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        for command, what in (
            ([sys.executable, "-m", "venv", str(venv)], "creating the venv"),
            ([str(python), "-m", "pip", "install", "-q", pip_spec], f"pip install {pip_spec}"),
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
    with _locked(CLIENTS_DIR / f"{prefix.name}.lock"):
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
