"""Starting and stopping the servers a benchmark measures, and metering their CPU.

Every benchmark starts the servers it measures here. In their own processes:
simulated replicas (`kvgate replica`), kvgate itself (`kvgate serve`, of this
installation or of another checkout) and helper servers (`python -m MODULE`). Each is
a subprocess of the current interpreter bound to a free port on 127.0.0.1, with its
output in a log file under the run's folder, and counts as started once an HTTP GET
of its readiness path answers 200. `ServerGroup` owns every process it started and
stops them all on exit, also when the run fails or the benchmark is stopped with
SIGINT or SIGTERM (while a group is open, SIGTERM cancels the task that opened it, the
group stops its processes, and the benchmark exits with status 143), so a benchmark
never leaves a server behind. In this process: `start_in_process` (a kvgate app on a free port, for
benchmarks that reach into the app: its gate, its registry). `process_cpu_seconds` is
the one CPU meter of the benchmarks.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvgate.bench.checkout import import_tree, package_dirs
from kvgate.bench.listeners import listens_on
from kvgate.proxy.app import ProxyApp, create_app
from kvgate.proxy.config import settings_from_dict
from kvgate.proxy.settings import Settings


@dataclass(frozen=True)
class ReplicaShape:
    """The `kvgate replica` options of every simulated replica of a run."""

    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = 8192  # None: the whole cache
    time_scale: float = 1.0
    prefill_token_s: float | None = None  # cost model: seconds per prompt token (None: the replica's default)
    step_overhead_s: float | None = None  # cost model: fixed seconds per step
    decode_seq_s: float | None = None  # cost model: seconds per decoding sequence
    context_token_s: float | None = None  # cost model: seconds per context token read
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs | priority

    def args(self) -> list[str]:
        args = [
            "--num-blocks",
            str(self.num_blocks),
            "--block-size",
            str(self.block_size),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--time-scale",
            str(self.time_scale),
            # A benchmark's workload sets every reply's length as its max_tokens: the
            # replica answers exactly that, never stopping early or calling a tool.
            "--reply-lengths",
            "max_tokens",
        ]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.scheduling_policy != "fcfs":
            args += ["--scheduling-policy", self.scheduling_policy]
        for name in ("prefill_token_s", "step_overhead_s", "decode_seq_s", "context_token_s"):
            value = getattr(self, name)
            if value is not None:
                args += ["--" + name.replace("_", "-"), str(value)]
        return args

    def to_json(self) -> dict:
        return asdict(self)


# A server whose free port another process took before it bound it starts again on another.
START_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """Another process took the free port a server was given before the server bound it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Endpoint:
    """A started server: its name and base URL."""

    name: str
    url: str


def python_module(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def kvgate_command() -> list[str]:
    """The `kvgate` console script, as a module of this interpreter."""
    return python_module("kvgate.cli")


def checkout_launch(repo: Path, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that run the `kvgate` of checkout `repo` from its working directory:
    its `kvgate.*` packages through a link tree first on PYTHONPATH (bench/checkout.py), or, for a
    checkout from before the namespace, its top-level packages (`python -m proxy.cli`). The
    command line is `kvgate.cli`, or `kvgate.proxy.cli` in a checkout from before it had its own."""
    dirs = package_dirs(repo)
    if not dirs:
        return python_module("proxy.cli"), dict(os.environ)
    tree = import_tree(repo, workdir / "import-tree")
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    command = kvgate_command() if "kvgate.cli" in dirs else python_module("kvgate.proxy.cli")
    return command, {**os.environ, "PYTHONPATH": path}


@dataclass
class Kvgate:
    """A kvgate app running in this process."""

    name: str
    app: ProxyApp
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        await self.app.close()


async def start_in_process(name: str, settings: Settings | dict, **options: Any) -> Kvgate:
    """A kvgate app (`proxy.app.create_app(settings, **options)`) listening on a free port of
    127.0.0.1; `settings` may be a config as YAML gives it."""
    if isinstance(settings, dict):
        settings = settings_from_dict(settings)
    app = create_app(settings, **options)
    try:
        host, port = await app.start("127.0.0.1", 0)
    except BaseException:
        await app.close()
        raise
    return Kvgate(name, app, host, port)


def command_line(name: str, template: str, values: dict[str, str], port: int = 0) -> list[str]:
    """The command line of `template` (split as a shell would, then each `{port}` and every
    `{key}` of `values` filled in); ValueError, naming the placeholders it may use, for a
    placeholder it does not know or unbalanced quotes. `name`: the server's, for the message."""
    fields = {**values, "port": str(port)}
    try:
        return [part.format(**fields) for part in shlex.split(template)]
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"{name} command {template!r}: {exc!r}; it may use {{port}} and {sorted(values)}") from exc


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used so far (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kvgate_config(
    replica_urls: list[str], port: int, gate: dict, extra: dict | None = None, names: list[str] | None = None
) -> dict:
    """The YAML config of a benchmark proxy: the given replicas (named r0, r1, ... unless `names`),
    the gate settings, fast health, and `extra` top-level keys (role, ownership: bench/agentic/topologies.py)."""
    names = names or [f"r{i}" for i in range(len(replica_urls))]
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"name": name, "url": url} for name, url in zip(names, replica_urls)],
        "balancer": {"health": {"interval_sec": 1.0}},
        "gate": gate,
        **(extra or {}),
    }


# Open groups and the task that opened each: SIGTERM cancels those tasks (see ServerGroup).
# All of them run on the loop that holds the handler (the main thread's).
_open_groups: dict[ServerGroup, asyncio.Task] = {}
_handler_loop: list[asyncio.AbstractEventLoop] = []  # the loop the SIGTERM handler is installed on, if any
SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM


def _on_sigterm() -> None:
    for group, task in list(_open_groups.items()):
        if not group.terminated:  # a second SIGTERM must not cut the first one's cleanup short
            group.terminated = True
            task.cancel()


class ServerGroup:
    """Processes started for one run; `async with` stops them all at exit.

    Python's default SIGTERM action ends the process at once, without unwinding, which
    would leave every process started here running. So while a group is open in the main
    thread's event loop, SIGTERM cancels the task that opened it instead: the group stops
    its processes (also one still starting) and then raises SystemExit(143), the status
    a process ended by SIGTERM reports. The handler is installed by the first group
    opened and removed with the last one closed."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self.terminated = False  # set by SIGTERM while this group was open

    async def __aenter__(self) -> ServerGroup:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        if task is not None and not _handler_loop:
            try:
                loop.add_signal_handler(signal.SIGTERM, _on_sigterm)
                _handler_loop.append(loop)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or not Unix
                pass
        if task is not None and _handler_loop == [loop]:
            _open_groups[self] = task
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.stop_all()
        finally:
            if _open_groups.pop(self, None) is not None and not _open_groups:
                _handler_loop.pop().remove_signal_handler(signal.SIGTERM)
        if self.terminated:
            raise SystemExit(SIGTERM_EXIT_STATUS)

    def _spawn(
        self, name: str, command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("KVGATE_")}  # the config file rules
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        log.close()
        self._procs.append((name, proc))
        return proc

    async def _start_on_free_port(
        self, name: str, launch: Callable[[int], subprocess.Popen], ready_path: str = "/health"
    ) -> str:
        """The server `launch(port)` starts on a free port; its URL once `ready_path` answers
        200 from it. Where another process took the port first (`PortTaken`), the server
        is started again on another, START_ATTEMPTS times at most."""
        for _ in range(START_ATTEMPTS - 1):
            try:
                return await self._start_once(name, launch, ready_path)
            except PortTaken:
                pass
        return await self._start_once(name, launch, ready_path)

    async def _start_once(self, name: str, launch: Callable[[int], subprocess.Popen], ready_path: str) -> str:
        port = free_port()
        proc = launch(port)
        url = f"http://127.0.0.1:{port}"
        try:
            await self._wait_ok(name, proc, url + ready_path, port)
        except PortTaken:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
        return url

    async def start_replica(self, name: str, shape: ReplicaShape) -> str:
        """A simulated replica (`kvgate replica --name NAME`) of `shape`; its URL."""

        def launch(port: int) -> subprocess.Popen:
            args = ["replica", "--name", name, "--host", "127.0.0.1", "--port", str(port)] + shape.args()
            return self._spawn(name, kvgate_command() + args)

        return await self._start_on_free_port(name, launch)

    async def start_kvgate(
        self,
        name: str,
        replica_urls: list[str],
        gate: dict,
        extra: dict | None = None,
        names: list[str] | None = None,
        ready_path: str = "/ready",
    ) -> str:
        """`kvgate serve` with `kvgate_config(...)` (a free port); its URL once `ready_path` answers 200."""
        return await self.serve(
            name, lambda port: kvgate_config(replica_urls, port, gate, extra, names), ready_path=ready_path
        )

    async def serve(
        self, name: str, config: Callable[[int], dict], repo: Path | None = None, ready_path: str = "/ready"
    ) -> str:
        """`kvgate serve` with the config `config(port)` (port: a free one it must listen on), of
        this installation or of checkout `repo`; its URL once `ready_path` answers 200."""
        command, env = kvgate_command(), None
        if repo is not None:
            command, env = checkout_launch(repo, self.log_dir / name)
        config_path = self.log_dir / f"{name}.yaml"

        def launch(port: int) -> subprocess.Popen:
            config_path.write_text(yaml.safe_dump(config(port), sort_keys=False))
            return self._spawn(name, command + ["serve", "--config", str(config_path)], env=env, cwd=repo)

        return await self._start_on_free_port(name, launch, ready_path)

    async def start_module(self, name: str, module: str, args: list[str], port: int = 0) -> str:
        """A helper server `python -m MODULE ARGS --port PORT` (0: a free one); its URL once /health answers 200."""

        def launch(port: int) -> subprocess.Popen:
            return self._spawn(name, python_module(module) + args + ["--port", str(port)])

        if not port:
            return await self._start_on_free_port(name, launch)
        await self._wait_ok(name, launch(port), f"http://127.0.0.1:{port}/health", port)
        return f"http://127.0.0.1:{port}"

    async def start_command(self, name: str, template: str, values: dict[str, str], ready_path: str = "/health") -> str:
        """A server started with the command line `template` (split as a shell would, then
        each `{port}` and every `{key}` of `values` filled in; port: a free one it must
        listen on on 127.0.0.1); its URL once `ready_path` answers 200."""
        return await self._start_on_free_port(
            name, lambda port: self._spawn(name, command_line(name, template, values, port)), ready_path
        )

    async def _wait_ok(self, name: str, proc: subprocess.Popen, url: str, port: int, timeout_s: float = 60.0) -> None:
        """Until `url` answers 200 from `proc` (the process listening on `port`, where /proc
        tells); PortTaken where another process listens there or `proc` could not bind it."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    tail = self._log_tail(name)
                    error = PortTaken if "address already in use" in tail.lower() else RuntimeError
                    raise error(
                        f"{name} exited with {proc.returncode} before {url} answered; "
                        f"see {self.log_dir / (name + '.log')}:\n{tail}"
                    )
                try:
                    async with http.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                        if resp.status == 200:
                            if listens_on(proc.pid, port) is False:
                                raise PortTaken(f"{name}: another process answered on port {port}")
                            return
                except (TimeoutError, aiohttp.ClientError):
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(
            f"{name}: {url} did not answer 200 within {timeout_s:.0f}s; see {self.log_dir / (name + '.log')}"
        )

    def _log_tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def pids(self) -> dict[str, int]:
        """The process id of every process started, by name, while it runs."""
        return {name: proc.pid for name, proc in self._procs if proc.poll() is None}

    def kill(self, name: str) -> None:
        """SIGKILL the process started as `name` (a crash: nothing runs its shutdown)."""
        for proc_name, proc in self._procs:
            if proc_name == name and proc.poll() is None:
                proc.kill()
                proc.wait()

    async def stop_all(self) -> None:
        for _, proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10.0
        for _, proc in self._procs:
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._procs.clear()
