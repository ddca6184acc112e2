"""Splitting a host's CPUs between a vLLM engine and everything in front of it.

On a GPU host the engine's compute runs on the GPU: it never competes with the API
server, kvgate or the clients for a CPU. A vLLM CPU benchmark models that split by
giving the engine (vLLM's engine core process and its worker, whose OpenMP threads vLLM
binds through `VLLM_CPU_OMP_THREADS_BIND`) CPUs of its own, and the frontend (vLLM's API
server process, kvgate and the load generator) the rest.

Pure: `plan_split` (which CPUs each side gets; `PinningError` when the host cannot be
split), `descendants`, `violations` (threads outside their side's CPUs) and the CPU-list
text format. Linux I/O: `read_parents`, `thread_affinities`, `snapshot` (what each
process's threads may run on, from /proc) and `pin_process` / `pin_server_tree`.

Invariant of a split: `engine` and `frontend` are disjoint, neither is empty, and
together they are the CPUs the split was planned from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ENGINE = "engine"
FRONTEND = "frontend"


class PinningError(ValueError):
    """The CPUs at hand cannot be split as asked; the message says what to run instead."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """`0-2,5` (the kernel's Cpus_allowed_list and taskset's format) -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> `0-2,5`: ranges of consecutive CPUs, ascending (parse_cpu_list's inverse)."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class CpuSplit:
    """The engine's CPUs and the frontend's (disjoint, neither empty)."""

    engine: frozenset[int]
    frontend: frozenset[int]

    @property
    def omp_threads_bind(self) -> str:
        """`VLLM_CPU_OMP_THREADS_BIND` for one engine worker: its OpenMP threads, one per CPU."""
        return format_cpu_list(self.engine)

    def cpus_of(self, role: str) -> frozenset[int]:
        return self.engine if role == ENGINE else self.frontend

    def describe(self) -> str:
        return f"engine CPUs {format_cpu_list(self.engine)}, frontend CPUs {format_cpu_list(self.frontend)}"


def plan_split(available: Iterable[int], engine_cpus: int | None = None) -> CpuSplit:
    """The engine gets the highest-numbered `engine_cpus` CPUs of `available` (default: half,
    rounded down), the frontend the rest. The frontend keeps the low CPUs, where hosts tend
    to route interrupts, so the engine's steps are not interrupted by the network path."""
    cpus = sorted(set(available))
    if len(cpus) < 2:
        raise PinningError(
            f"pinned mode needs at least 2 CPUs, one for the engine and one for the API server, kvgate "
            f"and the load; this process may run on {format_cpu_list(cpus) or 'no CPU'} only. "
            "Run with --pinning unpinned, or give the process more CPUs (taskset, the container's cpuset)."
        )
    count = len(cpus) // 2 if engine_cpus is None else engine_cpus
    if not 1 <= count <= len(cpus) - 1:
        raise PinningError(
            f"the engine can have 1 to {len(cpus) - 1} of the {len(cpus)} CPUs "
            f"{format_cpu_list(cpus)} (the frontend needs at least one), not {count}"
        )
    return CpuSplit(engine=frozenset(cpus[-count:]), frontend=frozenset(cpus[:-count]))


def descendants(parents: Mapping[int, int], root: int) -> list[int]:
    """Every process below `root` in the tree `parents` (pid -> parent pid), ascending."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child != root:
                found.add(child)
                stack.append(child)
    return sorted(found)


@dataclass(frozen=True)
class ProcessAffinity:
    """One process's threads and the CPUs each may run on, with the side it belongs to."""

    pid: int
    name: str
    role: str  # ENGINE or FRONTEND
    threads: Mapping[int, frozenset[int]]  # thread id -> allowed CPUs

    @property
    def cpus(self) -> frozenset[int]:
        """The union of its threads' CPUs."""
        return frozenset().union(*self.threads.values()) if self.threads else frozenset()

    def describe(self) -> str:
        return (
            f"{self.role:8} pid {self.pid:<7} {self.name:<22} {len(self.threads):3} threads "
            f"on CPUs {format_cpu_list(self.cpus)}"
        )

    def as_dict(self) -> dict:
        return {
            "pid": self.pid,
            "name": self.name,
            "role": self.role,
            "threads": len(self.threads),
            "cpus": format_cpu_list(self.cpus),
        }


def violations(processes: Iterable[ProcessAffinity], split: CpuSplit) -> list[str]:
    """One line per process with a thread allowed outside its side's CPUs (empty: the split holds)."""
    found = []
    for process in processes:
        allowed = split.cpus_of(process.role)
        outside = {tid: cpus for tid, cpus in process.threads.items() if not cpus <= allowed}
        if outside:
            tids = ", ".join(f"{tid} on {format_cpu_list(cpus)}" for tid, cpus in sorted(outside.items()))
            found.append(
                f"{process.role} process {process.pid} ({process.name}) may run outside CPUs "
                f"{format_cpu_list(allowed)}: threads {tids}"
            )
    return found


# ---------------------------------------------------------------- Linux /proc


def read_parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """pid -> parent pid of every process now running."""
    parents = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # comm, field 2, is in parentheses and may hold spaces: the parent is after the last ')'
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended while being read
    return parents


def thread_affinities(pid: int) -> dict[int, frozenset[int]]:
    """thread id -> the CPUs it may run on (its Cpus_allowed_list); empty if `pid` has ended."""
    found = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[int(task.name)] = parse_cpu_list(line.split(":", 1)[1])
    return found


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def snapshot(roles: Mapping[int, str], name: Callable[[int], str] = process_name) -> list[ProcessAffinity]:
    """The affinity of each process in `roles` (pid -> role) that is still running, by pid."""
    found = []
    for pid in sorted(roles):
        threads = thread_affinities(pid)
        if threads:
            found.append(ProcessAffinity(pid, name(pid), roles[pid], threads))
    return found


def tree_roles(parents: Mapping[int, int], root: int, root_role: str, below_role: str) -> dict[int, str]:
    """`root` -> `root_role` and every process below it -> `below_role`."""
    return {root: root_role, **{pid: below_role for pid in descendants(parents, root)}}


def pin_process(pid: int, cpus: frozenset[int], passes: int = 5) -> int:
    """Restrict every thread of `pid` to `cpus`, leaving alone threads already inside them (the
    engine worker's OpenMP threads, each bound by vLLM to one of them). Repeats while threads
    appear (a thread starts with its creator's CPUs). Returns how many threads it moved."""
    moved = 0
    for _ in range(passes):
        outside = [tid for tid, allowed in thread_affinities(pid).items() if not allowed <= cpus]
        if not outside:
            break
        for tid in outside:
            try:
                os.sched_setaffinity(tid, cpus)
                moved += 1
            except ProcessLookupError:
                continue  # the thread ended
    return moved


def pin_server_tree(server_pid: int, split: CpuSplit) -> dict[int, int]:
    """vLLM's API server process (`server_pid`) onto the frontend's CPUs, every process below it
    (the engine core, the worker) onto the engine's. Returns pid -> threads moved."""
    roles = tree_roles(read_parents(), server_pid, FRONTEND, ENGINE)
    return {pid: pin_process(pid, split.cpus_of(role)) for pid, role in roles.items()}
