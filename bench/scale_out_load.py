"""Scale-out load test: many concurrent sessions through front doors over replica gates.

Layouts (each kvgate its own `kvgate serve` subprocess, each replica a `kvgate replica`
subprocess with `time_scale` 0 and a cache far larger than the load: no KV pressure, so
what differs between layouts is the cost of the tier itself):

- `single`: one standalone kvgate (gate enforcing, working_set policy) in front of every replica;
- `tiers`: a replica gate (`role: replica_gate`) beside each replica and `--front-doors`
  front doors (`role: front_door`, gate off) listing them; session i uses front door i mod F.

`--sessions` sessions (default 10,000) each run `--turns` turns back to back on their own
keep-alive connection (bench/gate_load.py's lean client: whole history + a tool result
per turn, the finish header on the last). After each run it checks, through every
kvgate's `/admin/state` and `/metrics`, that nothing leaked (no lease, window, waiter or
session record in any gate, no request in flight, no session tracked by a front door;
read again until nothing is left or 30 s have passed, as the last releases trail the
last answers) and that no gate reported a conflict, and that every session stayed on one replica. It
prints per run the turn latency (p50, p95) and throughput, and per layout the medians
and the added p50 of `tiers` over `single`. Exit 1 on a failed turn, a leak, a
conflict or a session that changed replica.

One process holds at most `ulimit -n` sockets (20,000 on the build machine): a single
kvgate with 10,000 sessions in flight needs one socket in and one out per session, so
run `single` at a few thousand sessions and `tiers` at 10,000.

Run: kvgate bench scale-out (or python -m kvgate.bench.scale_out_load) [--sessions 10000] [--turns 4] [--front-doors 4]
     [--replicas 4] [--layouts tiers] [--repeats 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvgate.bench.gate_load import SYSTEM_PROMPT, TOOL_RESULT, TurnResult, send_turn, started_replicas
from kvgate.bench.processes import ServerGroup, process_cpu_seconds
from kvgate.proxy.event_loop import run as serve_loop
from kvgate.simulator.percentiles import percentile

LAYOUTS = ("single", "tiers")
ADMIN_TOKEN = "scale-out-load"


@dataclass
class LayoutRun:
    layout: str
    sessions: int = 0
    turns: int = 0
    failed: int = 0
    seconds: float = 0.0
    turns_per_sec: float = 0.0
    turn_p50_ms: float = 0.0
    turn_p95_ms: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    leaked: dict[str, int] = field(default_factory=dict)
    conflicts: float = 0.0
    moved_sessions: int = 0
    killed_door_outstanding: int | None = None  # requests in flight at front door 0 when it was killed
    resent_turns: int = 0  # turns re-sent to another front door (at most the number above)
    sent_after_kill: int = 0  # turns written after the kill on a connection opened just before it
    peak_concurrent_sessions: int = 0  # sessions started and not yet finished, at most at once
    cpu_us_per_turn: dict[str, float] = field(default_factory=dict)  # kvgate CPU per turn, by tier


def cpu_by_tier(servers: ServerGroup) -> dict[str, float]:
    """CPU seconds so far of the kvgate processes, summed per tier (door, gate, single)."""
    out: dict[str, float] = {}
    for name, pid in servers.pids().items():
        tier = "door" if name.startswith("door") else "gate" if name.startswith("gate") else "single"
        out[tier] = out.get(tier, 0.0) + (process_cpu_seconds(pid) or 0.0)
    return out


async def kill_door(servers: ServerGroup, doors: Doors, after_sec: float) -> None:
    """SIGKILL front door 0 (a crash, not a clean stop) `after_sec` into the run."""
    await asyncio.sleep(after_sec)
    doors.outstanding_at_kill = doors.outstanding[0]
    doors.killed_at = time.perf_counter()
    servers.kill("door0")
    doors.dead.add(0)


class Doors:
    """The front doors clients use, which are still up, and how many requests each has outstanding."""

    def __init__(self, addresses: list[tuple[str, int]]) -> None:
        self.addresses = addresses
        self.outstanding = [0] * len(addresses)
        self.dead: set[int] = set()
        self.outstanding_at_kill: int | None = None
        self.resent = 0  # turns that were in flight at a killed door, re-sent to another one
        self.killed_at: float | None = None
        self.sent_after_kill = 0  # turns written to a killed door's connection after it died (never in flight)
        self.alive = 0  # sessions started and not finished
        self.peak_alive = 0

    def next_alive(self, door: int) -> int:
        for step in range(1, len(self.addresses) + 1):
            candidate = (door + step) % len(self.addresses)
            if candidate not in self.dead:
                return candidate
        raise RuntimeError("no front door left")


async def run_session(
    doors: Doors, door: int, name: str, turns: int, start_delay: float, think: list[float]
) -> list[TurnResult]:
    """bench/gate_load.py's session, failing over to the next front door when its own goes away:
    a turn that was in flight there is re-sent (counted in `doors.resent`). `think[i]`: seconds
    between turn i+1 and turn i+2 (the agent's tool call)."""
    await asyncio.sleep(start_delay)
    doors.alive += 1
    doors.peak_alive = max(doors.peak_alive, doors.alive)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    results: list[TurnResult] = []
    writer = None
    try:
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": f"tool result {turn} of {name}: {TOOL_RESULT}"})
            while True:
                if door in doors.dead:
                    door = doors.next_alive(door)
                    if writer is not None:
                        writer.close()
                        writer = None
                if writer is None:
                    try:
                        reader, writer = await asyncio.open_connection(*doors.addresses[door])
                    except OSError:
                        doors.dead.add(door)
                        continue
                doors.outstanding[door] += 1
                sent_at = time.perf_counter()
                try:
                    result = await send_turn(
                        reader, writer, *doors.addresses[door], name, messages, finish=turn == turns
                    )
                except (OSError, asyncio.IncompleteReadError):
                    if doors.killed_at is not None and sent_at > doors.killed_at:
                        doors.sent_after_kill += 1  # a connection opened just before the kill
                    else:
                        doors.resent += 1
                    doors.dead.add(door)
                    continue
                finally:
                    doors.outstanding[door] -= 1
                break
            results.append(result)
            if result.status != 200:
                break
            messages.append({"role": "assistant", "content": result.reply})
            if turn < turns and think[turn - 1]:
                await asyncio.sleep(think[turn - 1])
    finally:
        doors.alive -= 1
        if writer is not None:
            writer.close()
    return results


async def start_layout(
    servers: ServerGroup, layout: str, replicas: list, front_doors: int
) -> tuple[list[str], list[str]]:
    """(the URLs clients use, every kvgate URL) of `layout` in front of `replicas`."""
    admin = {"admin": {"token": ADMIN_TOKEN}}
    gate = {"mode": "enforce", "policy": "working_set"}
    if layout == "single":
        url = await servers.start_kvgate(
            "single", [r.url for r in replicas], gate, extra=admin, names=[r.name for r in replicas]
        )
        return [url], [url]
    gates = list(
        await asyncio.gather(
            *(
                servers.start_kvgate(
                    f"gate-{r.name}", [r.url], gate, extra={**admin, "role": "replica_gate"}, names=[r.name]
                )
                for r in replicas
            )
        )
    )
    doors = list(
        await asyncio.gather(
            *(
                servers.start_kvgate(
                    f"door{i}",
                    gates,
                    {"mode": "off"},
                    extra={**admin, "role": "front_door"},
                    names=[r.name for r in replicas],
                )
                for i in range(front_doors)
            )
        )
    )
    return doors, gates + doors


def leaks_of(state: dict) -> dict[str, int]:
    """What an /admin/state still holds once every session finished (all zero when clean)."""
    out: Counter[str] = Counter()
    out["replica_in_flight"] += sum(r["in_flight"] for r in state["replicas"])
    out["tracked_sessions"] += state.get("tracked_sessions", 0)
    for gate in state["gates"].values():
        out["leases"] += gate["leases"]
        out["windows"] += len(gate["windows"]["in_flight"]) + len(gate["windows"]["idle"])
        out["waiters"] += len(gate["waiters"]) + gate["waiters_anonymous"]
        out["sessions"] += len(gate["sessions"])
    return {k: v for k, v in out.items() if v}


async def inspect(urls: list[str]) -> tuple[dict[str, int], float]:
    """(leaks summed over kvgates, kvgate_gate_conflict summed over kvgates and replicas)."""
    leaks: Counter[str] = Counter()
    conflicts = 0.0
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for url in urls:
            async with http.get(url + "/admin/state", headers=headers) as resp:
                leaks.update(leaks_of(await resp.json()))
            async with http.get(url + "/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("kvgate_gate_conflict{"):
                        conflicts += float(line.rsplit(" ", 1)[1])
    return dict(leaks), conflicts


async def inspect_settled(urls: list[str], deadline_sec: float = 30.0) -> tuple[dict[str, int], float]:
    """`inspect(urls)` once nothing is left, or at `deadline_sec` with what is left then. The last
    answers reach the clients a moment before their leases are released (and, through front
    doors, before the replica gates' are): on a loaded machine that moment can take seconds,
    while a real leak stays."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_sec
    while True:
        leaks, conflicts = await inspect(urls)
        if not leaks or loop.time() >= give_up:
            return leaks, conflicts
        await asyncio.sleep(0.2)


async def run_layout(layout: str, replicas: list, args: argparse.Namespace, index: int, log_dir: Path) -> LayoutRun:
    result = LayoutRun(layout, sessions=args.sessions)
    async with ServerGroup(log_dir / f"{layout}-{index}") as servers:
        targets, kvgates = await start_layout(servers, layout, replicas, args.front_doors)
        rng = random.Random(args.seed + index)
        doors = Doors([(u.split("//")[1].split(":")[0], int(u.rsplit(":", 1)[1])) for u in targets])
        killer = None
        if args.kill_front_door_after is not None and layout == "tiers":
            killer = asyncio.ensure_future(kill_door(servers, doors, args.kill_front_door_after))
        cpu_before = cpu_by_tier(servers)
        started = time.perf_counter()
        sessions = await asyncio.gather(
            *(
                run_session(
                    doors,
                    i % len(doors.addresses),
                    f"{layout}-{index}-s{i}",
                    args.turns,
                    rng.uniform(0, args.ramp_sec),
                    [rng.uniform(0.5, 1.5) * args.think_sec for _ in range(args.turns)],
                )
                for i in range(args.sessions)
            ),
            return_exceptions=True,
        )
        result.peak_concurrent_sessions = doors.peak_alive
        cpu_after = cpu_by_tier(servers)
        result.seconds = time.perf_counter() - started
        if killer is not None:
            await killer
            result.killed_door_outstanding = doors.outstanding_at_kill
            result.resent_turns = doors.resent
            result.sent_after_kill = doors.sent_after_kill
            kvgates = [u for u in kvgates if u != targets[0]]
        errors = [s for s in sessions if isinstance(s, BaseException)]
        done = [s for s in sessions if not isinstance(s, BaseException)]
        turns = [t for session in done for t in session]
        result.turns = len(turns)
        result.failed = (
            sum(t.status != 200 for t in turns) + sum(args.turns - len(s) for s in done) + args.turns * len(errors)
        )
        ok = [t.seconds for t in turns if t.status == 200]
        if ok and args.kill_front_door_after is None:
            result.cpu_us_per_turn = {
                tier: round((cpu_after[tier] - cpu_before.get(tier, 0.0)) / len(ok) * 1e6, 1) for tier in cpu_after
            }
        result.turns_per_sec = len(ok) / result.seconds if result.seconds else 0.0
        result.turn_p50_ms = percentile(ok, 50, math.nan) * 1000
        result.turn_p95_ms = percentile(ok, 95, math.nan) * 1000
        result.reasons = dict(Counter(t.reason for t in turns))
        result.statuses = {str(k): v for k, v in sorted(Counter(t.status for t in turns).items())}
        result.moved_sessions = sum(len({t.replica for t in s}) > 1 for s in done)
        result.leaked, result.conflicts = await inspect_settled(kvgates)
        if errors:
            result.leaked["client_errors"] = len(errors)
            print(f"[scale-out] {len(errors)} sessions failed, first: {errors[0]!r}", flush=True)
    return result


async def run(args: argparse.Namespace) -> list[LayoutRun]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvgate-scale-out-"))
    print(f"[scale-out] logs under {log_dir}", flush=True)
    async with started_replicas(args, log_dir / "replicas") as replicas:
        results = []
        index = 0
        for _ in range(args.repeats):
            for layout in args.layouts:
                results.append(await run_layout(layout, replicas, args, index, log_dir))
                index += 1
                print(format_run(results[-1]), flush=True)
        return results


def format_run(r: LayoutRun) -> str:
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(r.reasons.items()))
    leaked = "none" if not r.leaked else ", ".join(f"{k}={v}" for k, v in r.leaked.items())
    killed = (
        ""
        if r.killed_door_outstanding is None
        else f" killed door0 with {r.killed_door_outstanding} in flight, re-sent {r.resent_turns}"
        f" (+{r.sent_after_kill} written after the kill to a connection opened before it)"
    )
    return (
        f"{r.layout:6s} sessions={r.sessions} (peak {r.peak_concurrent_sessions} at once) "
        f"turns={r.turns} failed={r.failed} wall={r.seconds:.1f}s "
        f"{r.turns_per_sec:.0f} turns/s turn p50={r.turn_p50_ms:.2f}ms p95={r.turn_p95_ms:.2f}ms "
        f"kvgate cpu/turn {r.cpu_us_per_turn}us statuses{r.statuses} reasons[{reasons}] leaked[{leaked}] "
        f"conflicts={r.conflicts:g} moved={r.moved_sessions}{killed}"
    )


def summarize(results: list[LayoutRun], layouts: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for layout in layouts:
        runs = [r for r in results if r.layout == layout]
        summary[layout] = {
            key: statistics.median(getattr(r, key) for r in runs)
            for key in ("turn_p50_ms", "turn_p95_ms", "turns_per_sec")
        }
        tiers = {tier for r in runs for tier in r.cpu_us_per_turn}
        summary[layout]["cpu_us_per_turn"] = {
            tier: statistics.median(r.cpu_us_per_turn.get(tier, 0.0) for r in runs) for tier in sorted(tiers)
        }
    if "single" in summary and "tiers" in summary:
        s, t = summary["single"], summary["tiers"]
        t["added_turn_p50_ms"] = t["turn_p50_ms"] - s["turn_p50_ms"]
        t["turn_p50_ratio_vs_single"] = t["turn_p50_ms"] / s["turn_p50_ms"] if s["turn_p50_ms"] else None
        t["throughput_ratio_vs_single"] = t["turns_per_sec"] / s["turns_per_sec"] if s["turns_per_sec"] else None
    return summary


DESCRIPTION = __doc__.split("\n\n")[0]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=10000, help="concurrent sessions (default 10000)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas (default 4)")
    parser.add_argument("--front-doors", type=int, default=4, help="front doors of the tiers layout (default 4)")
    parser.add_argument("--layouts", default="tiers", help="comma-separated: single, tiers (default tiers)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per layout, alternating (default 1)")
    parser.add_argument("--ramp-sec", type=float, default=2.0, help="sessions start within this many seconds")
    parser.add_argument(
        "--think-sec",
        type=float,
        default=0.0,
        help="mean tool time between a session's turns (uniform 0.5x-1.5x; default 0: back to back)",
    )
    parser.add_argument("--num-blocks", type=int, default=65536, help="KV blocks per replica (no pressure)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="simulated replica batch size")
    parser.add_argument(
        "--kill-front-door-after",
        type=float,
        metavar="SEC",
        help="tiers: SIGKILL front door 0 this many seconds into each run; its clients fail "
        "over to the next front door, re-sending only the turns that were in flight there",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", help="kvgate logs and configs (default: a new temporary folder)")
    parser.add_argument("--out", metavar="FILE", help="also write the runs and summary as JSON to FILE")


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    args.in_process_replicas = False
    if not args.layouts or any(x not in LAYOUTS for x in args.layouts):
        parser.error(f"--layouts takes {', '.join(LAYOUTS)}; got {args.layouts}")
    if min(args.sessions, args.turns, args.replicas, args.front_doors, args.repeats) < 1:
        parser.error("--sessions, --turns, --replicas, --front-doors and --repeats must be at least 1")
    return args


def add_command(subparsers) -> None:
    """`kvgate bench scale-out`."""
    parser = subparsers.add_parser(
        "scale-out",
        help="many concurrent sessions through front doors over replica gates (leaks, added latency)",
        description=DESCRIPTION,
    )
    configure(parser)
    parser.set_defaults(func=lambda args: report(validate(parser, args)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.bench.scale_out_load", description=DESCRIPTION)
    configure(parser)
    return report(validate(parser, parser.parse_args(argv)))


def report(args: argparse.Namespace) -> int:
    """Run the layouts of parsed `args`, print the summary; exit 1 on a failed turn, a leak, a
    conflict or a moved session."""
    print(
        f"scale-out load: {args.sessions} sessions x {args.turns} turns, {args.replicas} simulated replicas, "
        f"{args.front_doors} front doors, layouts {','.join(args.layouts)} x{args.repeats}",
        flush=True,
    )
    results: list[LayoutRun] = []

    async def collect() -> None:
        results.extend(await run(args))

    serve_loop(collect())  # uvloop when installed, as `kvgate serve`
    summary = summarize(results, args.layouts)
    for layout, s in summary.items():
        line = (
            f"{layout:6s} median turn p50={s['turn_p50_ms']:.2f}ms p95={s['turn_p95_ms']:.2f}ms "
            f"{s['turns_per_sec']:.0f} turns/s"
        )
        if "added_turn_p50_ms" in s:
            line += (
                f" | vs single: added turn p50={s['added_turn_p50_ms']:+.2f}ms "
                f"(ratio {s['turn_p50_ratio_vs_single']:.3f}), throughput ratio "
                f"{s['throughput_ratio_vs_single']:.3f}"
            )
        print(line + f" | kvgate CPU per turn (us, by tier) {s['cpu_us_per_turn']}")
    bad = [
        r
        for r in results
        if r.failed
        or r.leaked
        or r.conflicts
        or r.moved_sessions
        or (r.killed_door_outstanding is not None and r.resent_turns > r.killed_door_outstanding)
    ]
    print(f"failed turns: {sum(r.failed for r in results)}; runs with leaks, conflicts or moved sessions: {len(bad)}")
    if args.out:
        Path(args.out).write_bytes(
            orjson.dumps(
                {"args": vars(args), "runs": [vars(r) for r in results], "summary": summary}, option=orjson.OPT_INDENT_2
            )
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
