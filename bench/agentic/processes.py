"""Starting and stopping the servers of a run: simulated replicas and the kvgate proxy.

Each is a subprocess of the current interpreter (`python -m kvgate.cli ...`, the same
code as the `kvgate` console script), bound to a free port on 127.0.0.1, with its
output in a log file under the run's folder. `ServerGroup` owns every process it
started and stops them all on exit, also when the run fails, so a benchmark never
leaves a server behind.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import yaml


@dataclass(frozen=True)
class ReplicaShape:
    """The `kvgate replica` options of every simulated replica of a run."""

    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    time_scale: float = 1.0
    prefill_token_s: float | None = None  # cost model: seconds per prompt token (None: the replica's default)
    step_overhead_s: float | None = None  # cost model: fixed seconds per step
    decode_seq_s: float | None = None  # cost model: seconds per decoding sequence
    context_token_s: float | None = None  # cost model: seconds per context token read

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
            "--max-model-len",
            str(self.max_model_len),
            "--time-scale",
            str(self.time_scale),
        ]
        for name in ("prefill_token_s", "step_overhead_s", "decode_seq_s", "context_token_s"):
            value = getattr(self, name)
            if value is not None:
                args += ["--" + name.replace("_", "-"), str(value)]
        return args

    def to_json(self) -> dict:
        return asdict(self)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kvgate_command() -> list[str]:
    return [sys.executable, "-m", "kvgate.cli"]


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


class ServerGroup:
    """Processes started for one run; `async with` stops them all at exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[tuple[str, subprocess.Popen]] = []

    async def __aenter__(self) -> ServerGroup:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop_all()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("KVGATE_")}  # the config file rules
        proc = subprocess.Popen(kvgate_command() + args, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self._procs.append((name, proc))
        return proc

    async def start_replica(self, name: str, shape: ReplicaShape) -> str:
        port = free_port()
        proc = self._spawn(name, ["replica", "--host", "127.0.0.1", "--port", str(port)] + shape.args())
        url = f"http://127.0.0.1:{port}"
        await self._wait_ok(name, proc, url + "/health")
        return url

    async def start_kvgate(
        self,
        name: str,
        replica_urls: list[str],
        gate: dict,
        extra: dict | None = None,
        names: list[str] | None = None,
        ready_path: str = "/ready",
    ) -> str:
        port = free_port()
        config_path = self.log_dir / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(kvgate_config(replica_urls, port, gate, extra, names), sort_keys=False))
        proc = self._spawn(name, ["serve", "--config", str(config_path)])
        url = f"http://127.0.0.1:{port}"
        await self._wait_ok(name, proc, url + ready_path)
        return url

    async def _wait_ok(self, name: str, proc: subprocess.Popen, url: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} before {url} answered; "
                        f"see {self.log_dir / (name + '.log')}:\n{self._log_tail(name)}"
                    )
                try:
                    async with http.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                        if resp.status == 200:
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
