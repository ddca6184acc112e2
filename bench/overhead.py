"""`kvgate bench overhead`: what kvgate adds on top of talking to the upstream directly.

One invocation starts a fast local upstream (`kvgate.bench.overhead_upstream`) and kvgate in
front of it (`kvgate serve`, each in its own process), then runs closed-loop load
(`kvgate.bench.overhead_load`, a third process) at each concurrency, non-streaming and
streaming, alternating direct and proxied runs of `--duration` seconds, `--repeats`
times. It prints, per case, the median requests/s, p50 and p99 of each, the added
p50 (proxied - direct) and the throughput ratio (proxied / direct).

`--target URL` points the proxied runs at another router instead (started by you in
front of the upstream this command starts on `--upstream-port`), so any router can be
measured the same way; `--router-command CMD` starts another router itself and measures
it beside this kvgate, in the same run (in the baseline's place). `--baseline-repo DIR`
also starts the kvgate of another checkout (say, the previous commit) and measures it
in the same run, alternating with this one, so that a change is compared under the
same machine load (its `kvgate.*` packages are imported from its folders,
`bench/checkout.py`; a checkout from before the namespace, from its top-level
packages). `--sessions 100,1000,10000` measures instead how
the gate's CPU per request grows with the sessions it books (`bench/overhead_sessions.py`).
This prints numbers; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvgate.bench.processes import ServerGroup, command_line, process_cpu_seconds, python_module
from kvgate.gate.policies.registry import POLICIES
from kvgate.gate.settings import GateSettings

DEFAULT_CONCURRENCY = (1, 64, 256)
MODES = ("non-streaming", "streaming")


def add_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "overhead",
        help="measure the latency and throughput kvgate adds over a direct connection",
        description=__doc__.split("\n\n")[0] + " Direct and proxied runs alternate against the same "
        "upstream; medians over --repeats are reported.",
    )
    parser.add_argument("--duration", type=float, default=2.0, help="seconds of load per run (default 2)")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of load before timing (default 0.5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case and target; medians reported (default 3)")
    parser.add_argument(
        "--concurrency",
        default=",".join(map(str, DEFAULT_CONCURRENCY)),
        help="comma-separated concurrent clients (default 1,64,256)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated: non-streaming,streaming (default both)"
    )
    parser.add_argument(
        "--target",
        metavar="URL",
        help="measure this router instead of kvgate (it must forward to the upstream on --upstream-port)",
    )
    parser.add_argument(
        "--router-command",
        metavar="CMD",
        help="also measure, in the same run, another router that this starts with the command line CMD "
        "({port}: the port it must listen on, {upstream}: the upstream's URL; ready when GET /health "
        "answers 200), e.g. 'vllm-router --host 127.0.0.1 --port {port} --worker-urls {upstream}'",
    )
    parser.add_argument(
        "--upstream-port",
        type=int,
        default=0,
        help="port of the benchmark upstream (default: a free one; fix it for --target)",
    )
    parser.add_argument(
        "--gate-mode",
        default="enforce",
        choices=["enforce", "shadow", "off"],
        help="kvgate's gate.mode for the proxied runs (default enforce; the upstream reports an "
        "idle replica, so every request is admitted)",
    )
    parser.add_argument(
        "--gate-policy",
        default=GateSettings().policy,
        choices=sorted(POLICIES),
        help=f"kvgate's gate.policy for the proxied runs (default {GateSettings().policy}: "
        "working_set probes every named turn's prefix, watermark only above the watermark)",
    )
    parser.add_argument(
        "--baseline-repo",
        metavar="DIR",
        help="also measure the kvgate of this checkout (e.g. the previous commit, via git "
        "worktree), alternating with this one in the same run",
    )
    parser.add_argument(
        "--sessions",
        metavar="N,N,...",
        help="instead: kvgate's CPU per request with the gate off and on, per number of sessions N "
        "(the requests take N session ids in turn), against a calm replica, non-streaming; e.g. 100,1000,10000",
    )
    parser.add_argument(
        "--session-clients", type=int, default=16, help="concurrent clients of --sessions runs (default 16)"
    )
    parser.add_argument(
        "--session-rate",
        type=float,
        metavar="RPS",
        help="--sessions: after the closed-loop runs, also runs that send this many requests per second, "
        "gate off and on alike, so both kvgates serve the same load (default: closed loop only)",
    )
    parser.add_argument(
        "--body-kib",
        type=int,
        default=0,
        help="--sessions: each request carries an agent's history of tool calls and their results "
        "of this many KiB, as a coding agent's turns do (default 0: one short message)",
    )
    parser.add_argument(
        "--body-threads",
        type=int,
        default=1,
        help="--sessions: each session's requests take this many threads' histories in turn, as a main "
        "agent and its subagents do under one session id (default 1)",
    )
    parser.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    parser.set_defaults(func=overhead_command)


# ---- processes --------------------------------------------------------------------


def kvgate_config(port: int, upstream_url: str, gate_mode: str, gate_policy: str) -> dict:
    """kvgate in front of the benchmark upstream, listening on `port`."""
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"name": "upstream", "url": upstream_url}],
        "gate": {"mode": gate_mode, "policy": gate_policy},
    }


def run_load(
    url: str, concurrency: int, duration: float, warmup: float, stream: bool, extra: list[str] | None = None
) -> dict:
    """One run of the load generator (`extra`: more of its options); its JSON result."""
    args = ["--url", url, "--concurrency", str(concurrency), "--duration", str(duration), "--warmup", str(warmup)]
    if stream:
        args.append("--stream")
    out = subprocess.run(
        python_module("kvgate.bench.overhead_load") + args + (extra or []),
        capture_output=True,
        text=True,
        timeout=duration + warmup + 600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed against {url}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the measurement ------------------------------------------------------------------


def missing(value: float | None) -> bool:
    """No figure: a run that completed no request has no percentiles (the load generator
    writes them as null), a router without a CPU reading no CPU per request."""
    return value is None or math.isnan(value)


def fmt(value: float | None, spec: str) -> str:
    """`value` formatted with `spec` (`>9.3f`), or "n/a" in the same width when it is missing."""
    if missing(value):
        return format("n/a", ">" + spec.lstrip("<>^").split(".")[0])
    return format(value, spec)


def median(values) -> float | None:
    """The median of the values present, or None."""
    present = [v for v in values if not missing(v)]
    return statistics.median(present) if present else None


def summarize(runs: list[dict]) -> dict:
    """Medians over repeated runs of one (mode, concurrency, target)."""
    kinds: dict[str, int] = {}
    for r in runs:
        for kind, n in r.get("error_kinds", {}).items():
            kinds[kind] = kinds.get(kind, 0) + n
    cpu = [r["cpu_us_per_request"] for r in runs if "cpu_us_per_request" in r]
    return (
        {key: median(r[key] for r in runs) for key in ("rps", "p50_ms", "p99_ms")}
        | {"errors": sum(r["errors"] for r in runs), "error_kinds": kinds, "runs": len(runs)}
        | ({"cpu_us_per_request": statistics.median(cpu)} if cpu else {})
    )


def compare(direct: dict, proxied: dict) -> dict:
    p50s = (proxied["p50_ms"], direct["p50_ms"])
    return {
        "added_p50_ms": None if any(missing(p50) for p50 in p50s) else p50s[0] - p50s[1],
        "throughput_ratio": proxied["rps"] / direct["rps"] if direct["rps"] else float("nan"),
    }


def format_table(results: list[dict], proxied_name: str) -> str:
    header = (
        f"{'mode':<14}{'clients':>8} | {'direct rps':>11}{'p50 ms':>9}{'p99 ms':>9} | "
        f"{proxied_name + ' rps':>12}{'p50 ms':>9}{'p99 ms':>9} | {'added p50 ms':>13}{'ratio':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        d, p = r["direct"], r["proxied"]
        lines.append(
            f"{r['mode']:<14}{r['concurrency']:>8} | {fmt(d['rps'], '>11.0f')}{fmt(d['p50_ms'], '>9.3f')}"
            f"{fmt(d['p99_ms'], '>9.3f')} | {fmt(p['rps'], '>12.0f')}{fmt(p['p50_ms'], '>9.3f')}"
            f"{fmt(p['p99_ms'], '>9.3f')} | {fmt(r['added_p50_ms'], '>13.3f')}{fmt(r['throughput_ratio'], '>7.2f')}"
        )
    for r in results:
        for target in ("direct", "proxied"):
            if r[target]["errors"]:
                kinds = ", ".join(f"{k}: {n}" for k, n in r[target].get("error_kinds", {}).items())
                lines.append(
                    f"WARNING: {r['mode']} c={r['concurrency']} {target}: {r[target]['errors']} requests "
                    f"failed or answered non-200 ({kinds or 'see the JSON output'})"
                )
    return "\n".join(lines)


def measure(
    direct_url: str,
    proxied_url: str,
    concurrencies: list[int],
    modes: list[str],
    duration: float,
    warmup: float,
    repeats: int,
    progress=print,
    baseline_url: str | None = None,
    pids: dict[str, int] | None = None,
) -> list[dict]:
    """Alternating runs; with `pids` (target -> router process), each run also records
    the router's CPU per request, a figure that the machine's other load moves far
    less than requests/s."""
    runs: dict[tuple, list[dict]] = {}
    targets = [("direct", direct_url), ("proxied", proxied_url)]
    if baseline_url:
        targets.append(("baseline", baseline_url))
    pids = pids or {}
    for repeat in range(repeats):
        for mode in modes:
            for concurrency in concurrencies:
                for target, url in targets:
                    pid = pids.get(target)
                    before = process_cpu_seconds(pid) if pid else None
                    result = run_load(url, concurrency, duration, warmup, mode == "streaming")
                    after = process_cpu_seconds(pid) if pid else None
                    if before is not None and after is not None and result["requests"]:
                        # the warmup's requests are not counted, its CPU is: an upper bound
                        result["cpu_us_per_request"] = (after - before) / result["requests"] * 1e6
                    runs.setdefault((mode, concurrency, target), []).append(result)
                    progress(
                        f"  run {repeat + 1}/{repeats} {mode:<13} c={concurrency:<4} {target:<8} "
                        f"{fmt(result['rps'], '8.0f')} rps  p50 {fmt(result['p50_ms'], '.3f')} ms"
                    )
    results = []
    for mode in modes:
        for concurrency in concurrencies:
            direct = summarize(runs[(mode, concurrency, "direct")])
            proxied = summarize(runs[(mode, concurrency, "proxied")])
            results.append(
                {
                    "mode": mode,
                    "concurrency": concurrency,
                    "direct": direct,
                    "proxied": proxied,
                    **compare(direct, proxied),
                }
            )
            if baseline_url:
                baseline = summarize(runs[(mode, concurrency, "baseline")])
                results[-1]["baseline"] = baseline
                results[-1]["baseline_vs_direct"] = compare(direct, baseline)
    return results


def format_baseline_table(results: list[dict], proxied_name: str, other: str = "baseline") -> str:
    """Each case: the other router (`other`: the baseline checkout's kvgate, or the router of
    --router-command) against direct, and this kvgate against it."""
    header = (
        f"{'mode':<14}{'clients':>8} | {other + ' rps':>13}{'p50 ms':>9}{'added p50':>10}{'cpu us/req':>11} | "
        f"{proxied_name + ' rps':>12}{'p50 ms':>9}{'added p50':>10}{'cpu us/req':>11} | "
        f"{'rps vs ' + other:>16}{'cpu vs ' + other:>16}"
    )
    lines = [header, "-" * len(header)]
    nan = float("nan")
    for r in results:
        b, p, vs = r["baseline"], r["proxied"], r["baseline_vs_direct"]
        b_cpu, p_cpu = b.get("cpu_us_per_request", nan), p.get("cpu_us_per_request", nan)
        lines.append(
            f"{r['mode']:<14}{r['concurrency']:>8} | {fmt(b['rps'], '>13.0f')}{fmt(b['p50_ms'], '>9.3f')}"
            f"{fmt(vs['added_p50_ms'], '>10.3f')}{fmt(b_cpu, '>11.0f')} | {fmt(p['rps'], '>12.0f')}"
            f"{fmt(p['p50_ms'], '>9.3f')}{fmt(r['added_p50_ms'], '>10.3f')}{fmt(p_cpu, '>11.0f')} | "
            f"{fmt(p['rps'] / b['rps'] if b['rps'] else nan, '>16.2f')}"
            f"{fmt(p_cpu / b_cpu if b_cpu else nan, '>16.2f')}"
        )
    return "\n".join(lines)


def overhead_command(args: argparse.Namespace) -> int:
    if args.sessions:
        from kvgate.bench.overhead_sessions import parse_sizes, sessions_command

        try:
            parse_sizes(args.sessions)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        if args.body_kib < 0:
            print(f"--body-kib must be >= 0 (KiB of history per request), got {args.body_kib}", file=sys.stderr)
            return 2
        if args.body_threads < 1:
            print(f"--body-threads must be >= 1 (threads per session), got {args.body_threads}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
            return sessions_command(args, Path(tmp))
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        print(f"--concurrency must be comma-separated integers, got {args.concurrency!r}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or not concurrencies or min(concurrencies) < 1 or args.repeats < 1:
        print(f"--modes must name {' and/or '.join(MODES)}; --concurrency and --repeats must be >= 1", file=sys.stderr)
        return 2
    if args.router_command and (args.baseline_repo or args.target):
        print("--router-command measures beside this kvgate: not with --baseline-repo or --target", file=sys.stderr)
        return 2
    problem = args.router_command and router_command_problem(args.router_command)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        results, proxied_name = asyncio.run(run(args, concurrencies, modes, Path(tmp)))
    other = "router" if args.router_command else "baseline"
    print()
    print(format_table(results, proxied_name))
    if any("baseline" in r for r in results):
        print()
        print(format_baseline_table(results, proxied_name, other))
    if args.out:
        document = {"target": proxied_name, "results": results}
        if args.router_command:
            document["router_command"] = args.router_command  # its figures: each result's `baseline`
        Path(args.out).write_text(json.dumps(document, indent=2))
        print(f"\nwrote {args.out}")
    return 0


def router_command_problem(template: str) -> str | None:
    """What is wrong with `--router-command` `template`, said before any server starts: a
    placeholder it does not know, unbalanced quotes, or a program not found; None if nothing."""
    try:
        command = command_line("router", template, {"upstream": ""})
    except ValueError as exc:
        return f"--router-command: {exc}"
    if not command:
        return "--router-command is empty: give the command line that starts the router"
    if shutil.which(command[0]) is None:
        return f"--router-command: {command[0]}: no such program; install it or fix the command"
    return None


async def run(args: argparse.Namespace, concurrencies: list[int], modes: list[str], workdir: Path) -> tuple[list, str]:
    """Start the upstream, this kvgate (unless --target) and the baseline's, measure, stop them all."""
    async with ServerGroup(workdir) as servers:
        upstream_url = await servers.start_module(
            "upstream", "kvgate.bench.overhead_upstream", [], port=args.upstream_port
        )
        pids: dict[str, int] = {}
        if args.target:
            proxied_url, proxied_name = args.target.rstrip("/"), "target"
        else:
            proxied_url = await servers.serve(
                "kvgate", lambda port: kvgate_config(port, upstream_url, args.gate_mode, args.gate_policy)
            )
            pids["proxied"] = servers.pids()["kvgate"]
            proxied_name = "kvgate"
        baseline_url = None
        if args.router_command:
            baseline_url = await servers.start_command("router", args.router_command, {"upstream": upstream_url})
            pids["baseline"] = servers.pids()["router"]
            print(f"router of --router-command: {baseline_url}", flush=True)
        elif args.baseline_repo:
            baseline_url = await servers.serve(
                "baseline",
                lambda port: kvgate_config(port, upstream_url, args.gate_mode, args.gate_policy),
                repo=Path(args.baseline_repo).resolve(),
            )
            pids["baseline"] = servers.pids()["baseline"]
            print(f"baseline kvgate of {args.baseline_repo}: {baseline_url}", flush=True)
        print(
            f"upstream {upstream_url}, {proxied_name} {proxied_url}; {args.repeats} x {args.duration:g} s "
            f"per case, cpus={os.cpu_count()}",
            flush=True,
        )
        results = await asyncio.to_thread(
            measure,
            upstream_url,
            proxied_url,
            concurrencies,
            modes,
            args.duration,
            args.warmup,
            args.repeats,
            progress=lambda line: print(line, flush=True),
            baseline_url=baseline_url,
            pids=pids,
        )
    return results, proxied_name
