"""`kvgate sim cluster`: compare policies on a simulated fleet in virtual time, or sweep its size.

Writes to --out: `report.json` (per policy, `report.summarize`; byte-identical for the
same options), `table.md`, `timeline_<policy>.csv`, `timeline.png`; with several
`--replicas`, `sweep.json`, `sweep.md` and `sweep.png` (and each size's files in
`replicas_<N>/`). Wall-clock and CPU time go to stdout only.

The runs of one command (each policy at each replica count) are independent: with
`--jobs` above 1 they run in that many processes at once, and the outputs are the same
as one after the other.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from kvgate.bench.agentic.regimes import REGIMES
from kvgate.bench.agentic.workload import WorkloadSpec, generate_workload
from kvgate.bench.cluster.plots import write_sweep_plot, write_timeline_plot
from kvgate.bench.cluster.presets import CLUSTER_PRESETS, ClusterPreset
from kvgate.bench.cluster.report import format_least_makespan, format_sweep, format_table, summarize
from kvgate.bench.cluster.run import PRIORITY, ClusterConfig, RunResult, parse_event, policy_names, run_policy
from kvgate.bench.cluster.seed_sweep import baseline_of, format_seeds, parse_seeds, seed_ratios
from kvgate.bench.cluster.workload import AgentSessions, sessions_of, sessions_of_trace
from kvgate.bench.gate_options import add_gate_options, gate_overrides
from kvgate.simulator.agent_trace import AgentTraceSpec, generate_trace
from kvgate.simulator.config import ConfigError, CostModel, EngineConfig


def _regime_names() -> list[str]:
    return [*CLUSTER_PRESETS, *REGIMES]


def add_cluster_command(sim_subparsers) -> None:
    parser = sim_subparsers.add_parser(
        "cluster",
        help="the real gate and balancer over many simulated replicas, in virtual time",
        description="Run agents through the real admission gate and balancer over N simulated vLLM engines "
        "in virtual time, once per policy (sticky = gate off, each gate policy, priority = working_set on "
        "replicas that schedule by priority, its held turns sent at low priority, direct = round-robin pinning), "
        "and report makespan, throughput, hit rate against the ceiling, latency percentiles, per-replica "
        "balance and plots over time. Deterministic: the same options give the same report.",
    )
    parser.add_argument(
        "--regime",
        default="fleet",
        choices=_regime_names(),
        help="workload, replica shape and gate settings: a cluster preset, or any `kvgate bench agentic` regime "
        "(its fixed sessions, unless --agents is given) (default fleet)",
    )
    parser.add_argument(
        "--replicas", default=None, help="replica count, or a comma list to sweep (default: the regime's)"
    )
    parser.add_argument("--agents", type=int, default=None, help="agents in a closed loop (default: the regime's)")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of traffic for --agents runs (default: the regime's)"
    )
    parser.add_argument(
        "--policies", default="all", help=f"comma list from {', '.join(policy_names())}, or all (default all)"
    )
    parser.add_argument(
        "--event",
        action="append",
        default=[],
        metavar="KIND@SECONDS:ARG",
        help="remove@1800:r3 (a replica fails / is removed), add@2400:r64, agents@600:2048 (load step); repeatable",
    )
    parser.add_argument(
        "--fail-at-half", action="store_true", help="shorthand: replica r0 is removed at half the duration"
    )
    parser.add_argument("--seed", type=int, default=None, help="workload seed (default 0)")
    parser.add_argument(
        "--seeds",
        default=None,
        metavar="LIST",
        help="run every policy on each of these workload seeds (a comma list and ranges: 0-5, 0,3,7) and report "
        "each policy's makespan, session p95 and mean turn time over sticky's (else the first policy's) on the "
        "same seed: their mean, worst and each seed's; each seed's outputs in seed_<S>/ (not with --seed or a "
        "--replicas list)",
    )
    parser.add_argument("--p95", type=float, default=None, help="turn-latency p95 target (s) the sweep answers for")
    parser.add_argument("--sample-sec", type=float, default=None, help="timeline sampling interval (virtual s)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica (default: the regime's)")
    parser.add_argument("--time-scale", type=float, default=None, help="cost-model multiplier (default: the regime's)")
    parser.add_argument(
        "--pins",
        choices=("auto", "off"),
        default=None,
        help="gate.pins: the gate pins the windows it admits for in the engines (auto), or not (off) "
        "(default: the regime's, else auto)",
    )
    parser.add_argument(
        "--cpu-tier",
        type=float,
        default=0.0,
        metavar="X",
        help="a CPU tier on every replica (vLLM's KV offloading) of X times its GPU KV blocks, loads priced at "
        "the model's KV bytes over PCIe Gen5; 0 = none (default 0)",
    )
    parser.add_argument("--no-jump", action="store_true", help="step every engine step (the reference; slower)")
    parser.add_argument("--out", type=Path, default=Path("results/sim_cluster"), help="output folder")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs (policies x replica counts) at once, in separate processes; the outputs do not depend "
        "on it (default: the CPUs, at most the runs)",
    )
    add_gate_options(
        parser, "gate settings of the gate policies' runs (override the regime's; docs/reference.md, Configuration)"
    )
    parser.set_defaults(func=run_cluster_command)


def _preset(args) -> ClusterPreset:
    preset = CLUSTER_PRESETS.get(args.regime)
    if preset is not None:
        return preset
    regime = REGIMES[args.regime]
    shape = regime.simulated_shape()
    engine = EngineConfig(
        shape.num_blocks, shape.block_size, shape.max_num_seqs, shape.max_num_batched_tokens, shape.max_model_len
    )
    costs = {
        name: getattr(shape, name)
        for name in ("step_overhead_s", "prefill_token_s", "decode_seq_s", "context_token_s")
        if getattr(shape, name, None) is not None
    }
    token_scale = getattr(regime.workload, "token_scale", 1.0)  # a trace regime's coarsening
    cost = CostModel(**costs, cpu_load_block_s=CostModel().cpu_load_block_s * token_scale)
    return ClusterPreset(
        regime.name,
        regime.description,
        regime.workload,
        engine,
        cost,
        shape.time_scale,
        regime.replicas,
        regime.gate,
        token_scale=token_scale,
    )


def build_config(args, replicas: int, seed: int | None = None) -> ClusterConfig:
    """The ClusterConfig the options describe, on workload `seed` (default: `--seed`, else 0);
    raises ValueError / ConfigError naming a bad option."""
    preset = _preset(args)
    if seed is None:
        seed = 0 if args.seed is None else args.seed
    engine = preset.engine
    if args.num_blocks is not None:  # a smaller cache caps the model length, as vLLM's start-up check does
        cache = args.num_blocks * engine.block_size
        limit = None if engine.max_model_len is None else min(engine.max_model_len, cache)
        engine = dataclasses.replace(engine, num_blocks=args.num_blocks, max_model_len=limit)
    if args.cpu_tier < 0:
        raise ValueError(f"--cpu-tier must be >= 0, 0 for none (got {args.cpu_tier:g})")
    engine = dataclasses.replace(engine, cpu_blocks=round(args.cpu_tier * engine.num_blocks))
    engine.validate()
    agents = preset.agents if args.agents is None else args.agents
    duration = preset.duration_s if args.duration is None else args.duration
    events = [parse_event(text) for text in args.event]
    if args.fail_at_half:
        if not agents:
            raise ValueError("--fail-at-half needs an --agents run (a duration to halve)")
        events.append(parse_event(f"remove@{duration / 2:g}:r0"))
    if agents and not isinstance(preset.workload, WorkloadSpec):
        raise ValueError(f"--agents: regime {preset.name} is an agent trace; it runs its own agents and sessions")
    config = ClusterConfig(
        replicas=replicas,
        engine=engine,
        cost_model=preset.cost_model,
        time_scale=preset.time_scale if args.time_scale is None else args.time_scale,
        gate={**preset.gate, **({} if args.pins is None else {"pins": args.pins}), **gate_overrides(args)},
        send_finish=getattr(preset.workload, "send_finish", False),  # an agent trace announces no end
        events=tuple(events),
        token_scale=preset.token_scale,
        jump=not args.no_jump,
    )
    if agents:
        assert isinstance(preset.workload, WorkloadSpec)  # checked above
        if duration <= 0:
            raise ValueError("--duration must be > 0 for an --agents run")
        return dataclasses.replace(
            config,
            agent_sessions=AgentSessions(preset.workload, seed, preset.token_scale),
            agents=agents,
            duration_s=duration,
            sample_sec=args.sample_sec or max(1.0, duration / 360),
        )
    if isinstance(preset.workload, AgentTraceSpec):  # a trace regime: its agents run its sessions
        trace = generate_trace(preset.workload, seed)
        return dataclasses.replace(
            config,
            sessions=tuple(sessions_of_trace(trace)),
            concurrency=preset.workload.agents,
            sample_sec=args.sample_sec or 1.0,
        )
    workload = generate_workload(preset.workload, seed)
    return dataclasses.replace(
        config,
        sessions=tuple(sessions_of(workload)),
        concurrency=preset.workload.concurrency,
        start_interval_s=preset.workload.start_interval_s,
        sample_sec=args.sample_sec or 1.0,
    )


def _policies(text: str) -> list[str]:
    names = policy_names()
    if text == "all":
        return list(names)
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in names]
    if unknown or not chosen:
        raise ValueError(f"--policies: unknown {unknown}; choose from {', '.join(names)} or all")
    return chosen


def _write_timeline(path: Path, timeline: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(timeline[0]), lineterminator="\n")
        writer.writeheader()
        for row in timeline:
            writer.writerow({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})


@dataclass
class PolicyRun:
    """One policy's run at one replica count, as the outputs need it."""

    summary: dict
    timeline: list[dict]
    events: list[tuple[float, str]]
    wall_s: float
    cpu_s: float


def _run_one(config: ClusterConfig, policy: str) -> PolicyRun:
    wall, cpu = time.perf_counter(), time.process_time()
    result: RunResult = run_policy(config, policy)
    return PolicyRun(
        summarize(result), result.timeline, result.events, time.perf_counter() - wall, time.process_time() - cpu
    )


def run_all(
    runs: list[tuple[ClusterConfig, str]], jobs: int, on_done: Callable[[int, PolicyRun], None] | None = None
) -> list[PolicyRun]:
    """Every (config, policy) run, in order; `jobs` > 1 runs them in that many processes
    (fresh interpreters: nothing of this one's state is shared). `on_done(index, run)` is
    called as each run ends."""
    done = on_done or (lambda index, run: None)
    if jobs <= 1 or len(runs) <= 1:
        results = []
        for index, (config, policy) in enumerate(runs):
            results.append(_run_one(config, policy))
            done(index, results[-1])
        return results
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=context) as pool:
        futures = {pool.submit(_run_one, config, policy): index for index, (config, policy) in enumerate(runs)}
        for future in as_completed(futures):
            done(futures[future], future.result())
        return [future.result() for future in futures]


def progress_line(config: ClusterConfig, policy: str, run: PolicyRun) -> str:
    summary = run.summary
    return (
        f"[cluster] {config.replicas} replicas, {policy}: {summary['turns_ok']} turns, makespan "
        f"{summary['makespan_s']:.1f}s, hit rate {summary['hit_rate']:.3f}, turn p95 "
        f"{summary['turn_latency_s']['p95']}s (wall {run.wall_s:.1f}s, CPU {run.cpu_s:.1f}s)"
    )


def run_table(config: ClusterConfig, summaries: dict[str, dict]) -> str:
    """The run's table; under a fixed-session run's, its least makespan (an agents' run lasts its duration)."""
    least = format_least_makespan(summaries) if config.agent_sessions is None else ""
    return format_table(summaries) + least


def write_outputs(
    config: ClusterConfig, policies: list[str], runs: list[PolicyRun], out: Path, plots: bool, title: str
) -> dict:
    """Write one replica count's outputs into `out` (its runs in `policies` order); the summaries by policy."""
    out.mkdir(parents=True, exist_ok=True)
    summaries: dict[str, dict] = {}
    timelines: dict[str, list[dict]] = {}
    events: list[tuple[float, str]] = []
    for policy, run in zip(policies, runs, strict=True):
        summaries[policy] = run.summary
        timelines[policy] = run.timeline
        events = events or run.events
        _write_timeline(out / f"timeline_{policy}.csv", run.timeline)
    (out / "report.json").write_text(json.dumps({"config": describe(config), "policies": summaries}, indent=1) + "\n")
    (out / "table.md").write_text(run_table(config, summaries))
    if plots:
        write_timeline_plot(timelines, events, out / "timeline.png", title)
    return summaries


def describe(config: ClusterConfig) -> dict:
    """The run's settings as JSON (the report's header)."""
    return {
        "replicas": config.replicas,
        "engine": dataclasses.asdict(config.engine),
        "cost_model": dataclasses.asdict(config.cost_model),
        "time_scale": config.time_scale,
        "gate": config.gate,
        "agents": config.agents,
        "duration_s": config.duration_s,
        "sessions": len(config.sessions),
        "concurrency": config.concurrency,
        "workload": None
        if config.agent_sessions is None
        else dataclasses.asdict(config.agent_sessions.spec) | {"seed": config.agent_sessions.seed},
        "events": [event.describe() for event in config.events],
        "token_scale": config.token_scale,
        "jump": config.jump,
    }


def run_cluster_command(args) -> int:
    try:
        policies = _policies(args.policies)
        if gate_overrides(args).get("held_priority") and PRIORITY not in policies:
            raise ValueError(
                f"--held-priority: only the {PRIORITY} policy's replicas schedule by priority; "
                f"add {PRIORITY} to --policies (it runs working_set at held priority 1 unless set)"
            )
        preset = _preset(args)
        counts = [preset.replicas] if args.replicas is None else [int(n) for n in args.replicas.split(",")]
        if any(n < 1 for n in counts):
            raise ValueError("--replicas must be >= 1")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1 (got {args.jobs})")
        seeds = None if args.seeds is None else parse_seeds(args.seeds)
        if seeds is not None and (args.seed is not None or len(counts) > 1):
            raise ValueError(
                "--seeds runs one replica count on several seeds: give it without --seed and without a --replicas list"
            )
        configs = {n: build_config(args, n) for n in counts} if seeds is None else {}
        seeded = {} if seeds is None else {seed: build_config(args, counts[0], seed) for seed in seeds}
    except (ValueError, ConfigError) as err:
        print(f"kvgate sim cluster: {err}", file=sys.stderr)
        return 2
    if getattr(_preset(args).workload, "retry_prob", 0.0) > 0:
        print(f"[cluster] note: regime {args.regime} re-sends some turns (retry_prob); the simulation does not")
    jobs = args.jobs if args.jobs is not None else os.cpu_count() or 1
    if seeds is not None:
        return _run_seeds(args, seeded, policies, jobs)
    wall = time.perf_counter()
    pairs = [(configs[n], policy) for n in counts for policy in policies]
    runs = run_all(pairs, jobs, lambda index, run: print(progress_line(*pairs[index], run), flush=True))
    by_count = {n: runs[i * len(policies) : (i + 1) * len(policies)] for i, n in enumerate(counts)}
    if len(counts) == 1:
        n = counts[0]
        summaries = write_outputs(configs[n], policies, by_count[n], args.out, not args.no_plots, _title(args, n))
        print(run_table(configs[n], summaries), end="")
    else:
        sweep = {}
        for n in counts:
            sweep[n] = write_outputs(
                configs[n], policies, by_count[n], args.out / f"replicas_{n}", not args.no_plots, _title(args, n)
            )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep.json").write_text(
            json.dumps({"p95_target_s": args.p95, "sweep": {str(n): s for n, s in sweep.items()}}, indent=1) + "\n"
        )
        text = format_sweep(sweep, args.p95)
        (args.out / "sweep.md").write_text(text)
        if not args.no_plots:
            write_sweep_plot(sweep, args.p95, args.out / "sweep.png", f"{args.regime}: replica sweep")
        print(text, end="")
    _print_total(wall, runs, jobs, args.out)
    return 0


def _run_seeds(args, seeded: dict[int, ClusterConfig], policies: list[str], jobs: int) -> int:
    """`--seeds`: every policy on each seed's workload; each seed's outputs in seed_<S>/, the
    policies against the baseline over the seeds in seeds.json and seeds.md."""
    wall = time.perf_counter()
    pairs = [(config, policy) for config in seeded.values() for policy in policies]
    seeds = list(seeded)

    def progress(index: int, run: PolicyRun) -> None:
        line = progress_line(*pairs[index], run).removeprefix("[cluster] ")
        print(f"[cluster] seed {seeds[index // len(policies)]}, {line}", flush=True)

    runs = run_all(pairs, jobs, progress)
    by_seed: dict[int, dict[str, dict]] = {}
    for i, (seed, config) in enumerate(seeded.items()):
        own = runs[i * len(policies) : (i + 1) * len(policies)]
        title = f"{_title(args, config.replicas)}, seed {seed}"
        by_seed[seed] = write_outputs(config, policies, own, args.out / f"seed_{seed}", not args.no_plots, title)
    baseline = baseline_of(policies)
    document = {"baseline": baseline, "seeds": seeds, "ratios": seed_ratios(by_seed, baseline)}
    (args.out / "seeds.json").write_text(json.dumps(document, indent=1) + "\n")
    text = format_seeds(by_seed, baseline)
    (args.out / "seeds.md").write_text(text)
    print(text, end="")
    _print_total(wall, runs, jobs, args.out)
    return 0


def _print_total(wall: float, runs: list[PolicyRun], jobs: int, out: Path) -> None:
    """The command's last line: its wall clock since `wall`, its runs' CPU, where its outputs are."""
    print(
        f"[cluster] total wall {time.perf_counter() - wall:.1f}s, CPU {sum(run.cpu_s for run in runs):.1f}s "
        f"in {min(jobs, len(runs))} process(es); outputs in {out}"
    )


def _title(args, replicas: int) -> str:
    return f"{args.regime}: {replicas} replicas" + (f", {args.agents} agents" if args.agents else "")
