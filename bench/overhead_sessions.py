"""`kvgate bench overhead --sessions 100,1000,10000`: the gate's CPU per request as its books grow.

One invocation starts the benchmark upstream (`kvgate.bench.overhead_upstream`) as a calm
replica (a KV cache with room for every session's window, `CALM_KV_USED` of it in use)
and two kvgates in front of it, one with the gate off (`gate.mode: off`) and one with
it on (`enforce`, the chosen policy). Per number of sessions N, each kvgate is first
primed (every session sends one request), then the load generator's clients take the N
session ids in turn (a session's next turn comes once every other session has had one),
non-streaming, in runs of `--duration` seconds that alternate gate off and gate on,
`--repeats` times, closed loop (each client sends its next request when answered, so
each kvgate runs as fast as it can); with `--session-rate R`, the same again with the
clients paced to R requests/s together, so both kvgates serve the same load (a faster
kvgate batches more requests per event-loop wake-up at saturation, which the closed
loop counts in its favour); with `--body-kib K`, each request carries an agent's history
of K KiB (tool calls and their results), the size of a coding agent's turns, and with
`--body-threads T` each session's requests take T threads' histories in turn (a main agent
and its subagents under one session id). It prints,
per N and load, each kvgate's median CPU per request (its process's
user + system time over a run, warmup included, divided by the requests timed), the
ratio on / off, requests/s, the windows the gate holds after the runs
(`kvgate_windows`) and any request that failed or answered non-200. With
`--baseline-repo DIR` the kvgate of that checkout runs too, gate on, in the same
alternation (column `base`, ratio base / off): a change's scaling against its
predecessor's under the same machine load. It asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import urllib.request
from pathlib import Path

from kvgate.bench.overhead import fmt, kvgate_config, run_load
from kvgate.bench.processes import ServerGroup, process_cpu_seconds

# A calm replica: its KV cache holds every window of 10,000 sessions (~8 blocks each)
# many times over, and 2% of it is in use.
CALM_KV_BLOCKS = 1 << 20
CALM_KV_USED = 0.02
TARGETS = ("off", "on")  # and "base" with --baseline-repo


def parse_sizes(text: str) -> list[int]:
    """`--sessions`: comma-separated session counts, each >= 1."""
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sessions must be comma-separated integers >= 1, got {text!r}")
    return sizes


def windows_held(url: str) -> int | None:
    """The windows the kvgate at `url` holds, in flight and idle (`kvgate_windows`), or None."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line.startswith("kvgate_windows{")]
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines)) if lines else None


def body_options(args: argparse.Namespace) -> list[str]:
    """The load generator's options for the requests' body (`--body-kib`, `--body-threads`),
    primed and timed alike."""
    return (["--body-kib", str(args.body_kib)] if args.body_kib else []) + (
        ["--body-threads", str(args.body_threads)] if args.body_threads > 1 else []
    )


def measure_size(
    urls: dict[str, str], pids: dict[str, int], sessions: int, args: argparse.Namespace, progress=print
) -> dict:
    """Prime every kvgate (`urls`: by target) with `sessions` sessions, then alternate timed
    runs; medians per target. With `--session-rate`, paced runs follow (`row["paced"]`)."""
    clients = args.session_clients
    for target in urls:
        primed = run_load(
            urls[target], clients, 0.0, 0.0, False, ["--sessions", str(sessions), "--prime", *body_options(args)]
        )
        progress(f"  N={sessions:<6} gate {target:<3} primed: {primed['requests']} sessions, {primed['errors']} errors")
    row: dict = {"sessions": sessions, "clients": clients}
    row.update(_timed_runs(urls, pids, sessions, args, None, progress))
    if args.session_rate:
        row["paced"] = {
            "rate": args.session_rate,
            **_timed_runs(urls, pids, sessions, args, args.session_rate, progress),
        }
    row["windows"] = windows_held(urls["on"])
    return row


def _timed_runs(
    urls: dict[str, str], pids: dict[str, int], sessions: int, args: argparse.Namespace, rate: float | None, progress
) -> dict:
    """`--repeats` rounds of one run per target (closed loop, or paced at `rate` requests/s):
    each target's medians, and the CPU ratios on / off (and base / off)."""
    runs: dict[str, list[dict]] = {target: [] for target in urls}
    paced = ["--rate", str(rate)] if rate else []
    how = f"at {rate:g} rps" if rate else "closed loop"
    for repeat in range(args.repeats):
        for target in urls:
            before = process_cpu_seconds(pids[target])
            result = run_load(
                urls[target],
                args.session_clients,
                args.duration,
                args.warmup,
                False,
                ["--sessions", str(sessions), *paced, *body_options(args)],
            )
            after = process_cpu_seconds(pids[target])
            if before is not None and after is not None and result["requests"]:
                result["cpu_us_per_request"] = (after - before) / result["requests"] * 1e6
            runs[target].append(result)
            progress(
                f"  run {repeat + 1}/{args.repeats} N={sessions:<6} {how:<14} gate {target:<3} "
                f"{fmt(result['rps'], '8.0f')} rps {fmt(result.get('cpu_us_per_request'), '7.0f')} us/req"
            )
    out: dict = {}
    for target in urls:
        cpu = [r["cpu_us_per_request"] for r in runs[target] if "cpu_us_per_request" in r]
        out[target] = {
            "cpu_us_per_request": statistics.median(cpu) if cpu else None,
            "rps": statistics.median(r["rps"] for r in runs[target]),
            "errors": sum(r["errors"] for r in runs[target]),
            "runs": len(runs[target]),
        }
    off, on = out["off"]["cpu_us_per_request"], out["on"]["cpu_us_per_request"]
    out["cpu_ratio"] = on / off if on is not None and off else None
    if "base" in urls:
        base = out["base"]["cpu_us_per_request"]
        out["base_cpu_ratio"] = base / off if base is not None and off else None
    return out


def format_sessions_table(rows: list[dict]) -> str:
    """One line per size and load: closed loop, and paced (`--session-rate`) when measured."""
    header = (
        f"{'sessions':>9}{'windows':>9}{'load':>12} | {'off us/req':>11}{'off rps':>9} | "
        f"{'on us/req':>10}{'on rps':>9} | {'cpu on/off':>11}{'errors':>8}"
    )
    based = any("base" in r for r in rows)
    if based:
        header += f" | {'base us/req':>12}{'base/off':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        loads = [("closed", r)] + ([(f"{r['paced']['rate']:g} rps", r["paced"])] if "paced" in r else [])
        for load, part in loads:
            off, on = part["off"], part["on"]
            errors = sum(part[t]["errors"] for t in ("off", "on", "base") if t in part)
            line = (
                f"{r['sessions']:>9}{fmt(r['windows'], '>9.0f')}{load:>12} | {fmt(off['cpu_us_per_request'], '>11.0f')}"
                f"{fmt(off['rps'], '>9.0f')} | {fmt(on['cpu_us_per_request'], '>10.0f')}{fmt(on['rps'], '>9.0f')} | "
                f"{fmt(part['cpu_ratio'], '>11.2f')}{errors:>8}"
            )
            if based:
                line += f" | {fmt(part['base']['cpu_us_per_request'], '>12.0f')}{fmt(part['base_cpu_ratio'], '>9.2f')}"
            lines.append(line)
    return "\n".join(lines)


async def run_sessions(args: argparse.Namespace, sizes: list[int], workdir: Path) -> list[dict]:
    """Start the calm upstream and the two kvgates, measure every size, stop them all."""
    async with ServerGroup(workdir) as servers:
        upstream = await servers.start_module(
            "upstream",
            "kvgate.bench.overhead_upstream",
            ["--kv-blocks", str(CALM_KV_BLOCKS), "--kv-used", str(CALM_KV_USED)],
            port=args.upstream_port,
        )
        urls = {
            "off": await servers.serve("gate-off", lambda port: kvgate_config(port, upstream, "off", args.gate_policy)),
            "on": await servers.serve(
                "gate-on", lambda port: kvgate_config(port, upstream, "enforce", args.gate_policy)
            ),
        }
        pids = {"off": servers.pids()["gate-off"], "on": servers.pids()["gate-on"]}
        if args.baseline_repo:
            urls["base"] = await servers.serve(
                "baseline",
                lambda port: kvgate_config(port, upstream, "enforce", args.gate_policy),
                repo=Path(args.baseline_repo).resolve(),
            )
            pids["base"] = servers.pids()["baseline"]
            print(f"baseline kvgate of {args.baseline_repo}, gate on: {urls['base']}", flush=True)
        print(
            f"calm upstream {upstream}; kvgate gate off {urls['off']}, on {urls['on']} "
            f"(policy {args.gate_policy}); {args.repeats} x {args.duration:g} s per size and gate, "
            f"{args.session_clients} clients, "
            + (f"each request an agent's {args.body_kib} KiB history" if args.body_kib else "one short message each")
            + (f", {args.body_threads} threads per session" if args.body_threads > 1 else ""),
            flush=True,
        )
        rows = []
        for size in sizes:
            rows.append(
                await asyncio.to_thread(measure_size, urls, pids, size, args, lambda line: print(line, flush=True))
            )
    return rows


def sessions_command(args: argparse.Namespace, workdir: Path) -> int:
    """`kvgate bench overhead --sessions ...`: measure, print the table, write --out."""
    sizes = parse_sizes(args.sessions)
    rows = asyncio.run(run_sessions(args, sizes, workdir))
    print()
    print(format_sessions_table(rows))
    if args.out:
        Path(args.out).write_text(
            json.dumps({"sessions": rows, "body_kib": args.body_kib, "body_threads": args.body_threads}, indent=2)
        )
        print(f"\nwrote {args.out}")
    return 0
