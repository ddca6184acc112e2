"""The gate's load test: many concurrent multi-turn sessions through one proxy, no pressure.

Starts simulated replicas (default 2, `time_scale` 0, caches far larger than the
load needs; each in its own `kvgate replica` process unless `--in-process-replicas`)
and, per gate mode (default `off` then `enforce`, `--repeats` times,
alternating), a kvgate proxy app in this process with the real
`gate.admission.AdmissionController`. `--sessions` sessions (default 1,000) each
run `--turns` turns (default 10) back to back on their own keep-alive connection:
a chat request carrying the whole history plus a new tool result, the reply
appended; the last turn carries the finish header.

After each run it checks that nothing leaked: every lease released once, no window,
waiter, attempt or session record left in any gate, no replica in-flight count.
It reports per mode the client-side turn latency (p50, p95), the time spent inside
`acquire` + `release` (what the gate itself adds), the admission reasons seen in
`x-kvgate-admission`, and the added p50 of `enforce` over `off` in the same run, as
milliseconds and as a ratio (the goal is < 1 ms at p50). It prints numbers and
asserts none; the exit status is 1 only if a turn failed or something leaked.

Run: python -m kvgate.bench.gate_load [--sessions 1000] [--turns 10] [--replicas 2]
     [--modes off,enforce] [--policy watermark] [--repeats 1] [--in-process-replicas] [--out FILE]
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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from kvgate.balancer.settings import ReplicaSettings
from kvgate.bench.http1 import read_response
from kvgate.bench.processes import Endpoint, ReplicaShape, ServerGroup, start_in_process
from kvgate.gate.admission import AdmissionController
from kvgate.gate.policies.registry import POLICIES
from kvgate.gate.settings import GateSettings
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.settings import Settings
from kvgate.simulator.config import EngineConfig
from kvgate.simulator.percentiles import percentile
from kvgate.simulator.replica_server import start_simulated_replicas
from kvgate.simulator.reply_model import FIXED_LENGTHS

SYSTEM_PROMPT = "You are a coding agent working in a large repository. " * 6
TOOL_RESULT = "line of tool output with a file path and a short message; " * 4
PATH = "/v1/chat/completions"


# ---------------------------------------------------------------- a lean client


@dataclass
class TurnResult:
    status: int
    seconds: float
    reason: str
    reply: str
    replica: str = ""  # x-kvgate-replica (bench/scale_out_load.py checks sessions stay on theirs)


async def send_turn(reader, writer, host: str, port: int, session: str, messages: list, finish: bool) -> TurnResult:
    body = orjson.dumps({"model": "bench", "messages": messages, "max_tokens": 8})
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"x-session-id: {session}\r\n{'x-session-finish: true' + chr(13) + chr(10) if finish else ''}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    started = time.perf_counter()
    writer.write(head.encode() + body)
    response = await read_response(reader)
    seconds = time.perf_counter() - started
    reply = ""
    if response.status == 200:
        reply = orjson.loads(response.body)["choices"][0]["message"]["content"] or ""
    return TurnResult(
        response.status,
        seconds,
        (response.header(b"x-kvgate-admission") or b"-").decode(),
        reply,
        (response.header(b"x-kvgate-replica") or b"-").decode(),
    )


async def run_session(host: str, port: int, name: str, turns: int, start_delay: float) -> list[TurnResult]:
    await asyncio.sleep(start_delay)
    reader, writer = await asyncio.open_connection(host, port)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    results = []
    try:
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": f"tool result {turn} of {name}: {TOOL_RESULT}"})
            result = await send_turn(reader, writer, host, port, name, messages, finish=turn == turns)
            results.append(result)
            if result.status != 200:
                break
            messages.append({"role": "assistant", "content": result.reply})
    finally:
        writer.close()
    return results


# ------------------------------------------------------------ the measured gate


class TimedAdmission:
    """Seam 1 around the real controller, timing acquire and release (nothing else)."""

    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller
        self.acquire_seconds: list[float] = []
        self.release_seconds: list[float] = []

    async def acquire(self, replica, session_id, route_kind, body, elsewhere=None, body_size=None):
        started = time.perf_counter()
        lease = await self.controller.acquire(
            replica, session_id, route_kind, body, elsewhere=elsewhere, body_size=body_size
        )
        self.acquire_seconds.append(time.perf_counter() - started)
        return _TimedLease(lease, self.release_seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.controller, name)


class _TimedLease:
    """The lease with its `learn` and `release` timed together: the gate's cost at a turn's end."""

    __slots__ = ("lease", "samples", "reason", "wait_ms", "priority", "_learn_s")

    def __init__(self, lease, samples: list[float]) -> None:
        self.lease, self.samples = lease, samples
        self.reason, self.wait_ms, self.priority = lease.reason, lease.wait_ms, lease.priority
        self._learn_s = 0.0

    def learn(self, prompt_tokens: int, cached_tokens: int | None, output_tokens: int | None = None) -> None:
        started = time.perf_counter()
        self.lease.learn(prompt_tokens, cached_tokens, output_tokens)
        self._learn_s += time.perf_counter() - started

    def end_run(self) -> None:
        self.lease.end_run()

    def release(self, served: bool = True) -> None:
        # Called exactly once per lease: the proxy's turn_hold.Hold gives a lease back once.
        started = time.perf_counter()
        self.lease.release(served)
        self.samples.append(time.perf_counter() - started + self._learn_s)


# ----------------------------------------------------------------------- runs


@dataclass
class RunResult:
    mode: str
    turns: int = 0
    failed: int = 0
    seconds: float = 0.0
    turn_p50_ms: float = 0.0
    turn_p95_ms: float = 0.0
    gate_p50_us: float = 0.0
    gate_p99_us: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    leaked: dict[str, int] = field(default_factory=dict)


async def run_mode(mode: str, policy: str, replicas: list, args: argparse.Namespace, run_index: int) -> RunResult:
    gate = replace(GateSettings(), mode=mode, policy=policy)
    settings = Settings(gate=gate, replicas=tuple(ReplicaSettings(r.name, r.url) for r in replicas))
    metrics = KvgateMetrics()
    controller = AdmissionController(gate, metrics.gate)
    timed = TimedAdmission(controller)
    kvgate = await start_in_process(mode, settings, metrics=metrics, admission=timed, health_checks=False)
    app = kvgate.app
    rng = random.Random(args.seed + run_index)
    result = RunResult(mode)
    try:
        started = time.perf_counter()
        sessions = await asyncio.gather(
            *(
                run_session(
                    kvgate.host, kvgate.port, f"{mode}-{run_index}-s{i}", args.turns, rng.uniform(0, args.ramp_sec)
                )
                for i in range(args.sessions)
            )
        )
        result.seconds = time.perf_counter() - started
        turns = [t for session in sessions for t in session]
        result.turns = len(turns)
        result.failed = sum(t.status != 200 for t in turns) + sum(args.turns - len(s) for s in sessions)
        latencies = [t.seconds for t in turns if t.status == 200]
        result.turn_p50_ms = percentile(latencies, 50, math.nan) * 1000
        result.turn_p95_ms = percentile(latencies, 95, math.nan) * 1000
        gate_seconds = [a + r for a, r in zip(timed.acquire_seconds, timed.release_seconds)]
        result.gate_p50_us = percentile(gate_seconds, 50, math.nan) * 1e6
        result.gate_p99_us = percentile(gate_seconds, 99, math.nan) * 1e6
        result.reasons = dict(Counter(t.reason for t in turns))
        result.statuses = {str(k): v for k, v in Counter(t.status for t in turns).items()}
        counts = controller.counts()
        counts["replica_in_flight"] = sum(r.in_flight for r in app.registry.all())
        # one release per acquisition (Hold gives a lease back once), so the pairs above are a turn's each
        counts["unpaired_releases"] = len(timed.release_seconds) - len(timed.acquire_seconds)
        result.leaked = {k: v for k, v in counts.items() if v}
    finally:
        await app.close()
    return result


@asynccontextmanager
async def started_replicas(args: argparse.Namespace, log_dir: Path | None = None) -> AsyncIterator[list]:
    """`args.replicas` simulated replicas (.name, .url) without KV pressure, stopped on exit: in this
    process with `args.in_process_replicas`, else one `kvgate replica` process each (logs in `log_dir`,
    default a temporary folder)."""
    if args.in_process_replicas:
        replicas = await start_simulated_replicas(
            args.replicas,
            host="127.0.0.1",
            time_scale=0.0,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            reply_model=FIXED_LENGTHS,
        )
        try:
            yield replicas
        finally:
            await asyncio.gather(*(r.stop() for r in replicas), return_exceptions=True)
        return
    engine = EngineConfig()  # the replica's own defaults, but for the size and the speed
    shape = ReplicaShape(
        num_blocks=args.num_blocks,
        block_size=engine.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        time_scale=0.0,
    )
    with tempfile.TemporaryDirectory(prefix="kvgate-replicas-") as tmp:
        async with ServerGroup(log_dir or Path(tmp)) as servers:
            yield [Endpoint(f"sim{i}", await servers.start_replica(f"sim{i}", shape)) for i in range(args.replicas)]


async def run(args: argparse.Namespace) -> list[RunResult]:
    async with started_replicas(args) as replicas:
        results = []
        index = 0
        for _ in range(args.repeats):
            for mode in args.modes:
                results.append(await run_mode(mode, args.policy, replicas, args, index))
                index += 1
                print(format_run(results[-1]), flush=True)
        return results


# -------------------------------------------------------------------- report


def format_run(r: RunResult) -> str:
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(r.reasons.items()))
    leaked = "none" if not r.leaked else ", ".join(f"{k}={v}" for k, v in r.leaked.items())
    return (
        f"{r.mode:8s} turns={r.turns} failed={r.failed} wall={r.seconds:.1f}s "
        f"turn p50={r.turn_p50_ms:.2f}ms p95={r.turn_p95_ms:.2f}ms "
        f"gate acquire+release p50={r.gate_p50_us:.1f}us p99={r.gate_p99_us:.1f}us "
        f"reasons[{reasons}] leaked[{leaked}]"
    )


def summarize(results: list[RunResult], modes: list[str]) -> dict[str, Any]:
    by_mode = {m: [r for r in results if r.mode == m] for m in modes}
    summary: dict[str, Any] = {}
    for mode, runs in by_mode.items():
        summary[mode] = {
            "turn_p50_ms": statistics.median(r.turn_p50_ms for r in runs),
            "turn_p95_ms": statistics.median(r.turn_p95_ms for r in runs),
            "gate_p50_us": statistics.median(r.gate_p50_us for r in runs),
            "gate_p99_us": statistics.median(r.gate_p99_us for r in runs),
        }
    if "off" in summary:
        base = summary["off"]
        for mode in modes:
            if mode == "off":
                continue
            s = summary[mode]
            s["added_turn_p50_ms"] = s["turn_p50_ms"] - base["turn_p50_ms"]
            s["turn_p50_ratio_vs_off"] = s["turn_p50_ms"] / base["turn_p50_ms"] if base["turn_p50_ms"] else None
            s["added_gate_p50_us"] = s["gate_p50_us"] - base["gate_p50_us"]
    return summary


DESCRIPTION = (
    "Load test of the admission gate: concurrent multi-turn sessions through one proxy to "
    "simulated replicas with no KV pressure; reports leaks and the gate's added latency."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=1000, help="concurrent sessions (default 1000)")
    parser.add_argument("--turns", type=int, default=10, help="turns per session (default 10)")
    parser.add_argument("--replicas", type=int, default=2, help="simulated replicas (default 2)")
    parser.add_argument(
        "--modes",
        default="off,enforce",
        help="comma-separated gate modes, run in this order each repeat (default off,enforce)",
    )
    parser.add_argument(
        "--policy",
        default=GateSettings().policy,
        choices=sorted(POLICIES),
        help=f"gate.policy (default {GateSettings().policy}, kvgate's default)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating (default 1)")
    parser.add_argument(
        "--ramp-sec",
        type=float,
        default=1.0,
        help="sessions start at random times within this many seconds (default 1)",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=65536,
        help="KV blocks per simulated replica, large so there is no pressure (default 65536)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="simulated replica batch size (default 256)")
    parser.add_argument(
        "--in-process-replicas",
        action="store_true",
        help="run the simulated replicas in this process (default: one subprocess each)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="FILE", help="also write the runs and summary as JSON to FILE")


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()] if isinstance(args.modes, str) else args.modes
    bad = [m for m in args.modes if m not in ("off", "enforce", "shadow")]
    if bad or not args.modes:
        parser.error(f"--modes takes off, enforce and shadow; got {args.modes}")
    if args.sessions < 1 or args.turns < 1 or args.replicas < 1 or args.repeats < 1:
        parser.error("--sessions, --turns, --replicas and --repeats must be at least 1")
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvgate.bench.gate_load", description=DESCRIPTION)
    configure(parser)
    return validate(parser, parser.parse_args(argv))


def add_command(subparsers) -> None:
    """`kvgate bench gate-load`."""
    parser = subparsers.add_parser(
        "gate-load", help="1,000-session load test of the gate (leaks, added latency)", description=DESCRIPTION
    )
    configure(parser)
    parser.set_defaults(func=lambda args: report(validate(parser, args)))


def main(argv: list[str] | None = None) -> int:
    return report(parse_args(argv))


def report(args: argparse.Namespace) -> int:
    """Run the load test of parsed `args`, print the summary; exit 1 on failed turns or leaks."""
    print(
        f"gate load: {args.sessions} sessions x {args.turns} turns, {args.replicas} simulated replicas, "
        f"modes {','.join(args.modes)} x{args.repeats}, policy {args.policy}",
        flush=True,
    )
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        results = runner.run(run(args))
    summary = summarize(results, args.modes)
    for mode, s in summary.items():
        line = f"{mode:8s} median turn p50={s['turn_p50_ms']:.2f}ms gate p50={s['gate_p50_us']:.1f}us"
        if "added_turn_p50_ms" in s:
            line += (
                f" | vs off: added turn p50={s['added_turn_p50_ms']:+.2f}ms "
                f"(ratio {s['turn_p50_ratio_vs_off']:.3f}), added gate p50={s['added_gate_p50_us']:+.1f}us"
            )
        print(line)
    failed = sum(r.failed for r in results)
    leaked = [r for r in results if r.leaked]
    print(f"failed turns: {failed}; runs with leaks: {len(leaked)}")
    if args.out:
        with open(args.out, "wb") as f:
            f.write(
                orjson.dumps(
                    {
                        "args": {k: v for k, v in vars(args).items()},
                        "runs": [vars(r) for r in results],
                        "summary": summary,
                    },
                    option=orjson.OPT_INDENT_2,
                )
            )
    return 1 if failed or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
