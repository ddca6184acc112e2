"""`kvgate sim admission`: run the admission experiment and write its outputs."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvgate.simulator.admission_policies import POLICY_NAMES
from kvgate.simulator.config import ConfigError, EngineConfig
from kvgate.simulator.experiment import DEFAULT_ENGINE, ExperimentConfig, run_experiment
from kvgate.simulator.experiment_report import format_table, write_metrics, write_plots, write_timeline
from kvgate.simulator.workload import WorkloadParams

WORKLOAD_OPTIONS = (
    ("num_requests", int, "requests in the workload"),
    ("arrival_rate", float, "ordinary requests arriving per step (Poisson)"),
    ("prompt_len_min", int, "shortest ordinary prompt, tokens"),
    ("prompt_len_max", int, "longest ordinary prompt, tokens"),
    ("output_len_min", int, "shortest output, tokens"),
    ("output_len_max", int, "longest output, tokens"),
    ("burst_interval", int, "steps between bursts of long prompts"),
    ("burst_size", int, "long prompts per burst (0: no bursts)"),
    ("long_prompt_len_min", int, "shortest long prompt, tokens"),
    ("long_prompt_len_max", int, "longest long prompt, tokens"),
    ("oversize_every", int, "every Nth request has a prompt larger than the cache (0: none)"),
)


def add_sim_command(subparsers, experiments: Sequence[Callable[[Any], None]] = ()) -> None:
    """`kvgate sim`, with `admission` and the `experiments` the command line adds (each
    `add(sim_subparsers)`: the cluster simulation, which drives the real gate, lives
    outside the engine model's dependencies)."""
    sim = subparsers.add_parser("sim", help="simulator experiments", description="Deterministic simulator experiments.")
    sim_sub = sim.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for add in experiments:
        add(sim_sub)
    parser = sim_sub.add_parser(
        "admission",
        help="the continuous-batching admission experiment (naive / reserve / reserve_watermark)",
        description="Run the same synthetic FCFS workload (Poisson arrivals plus bursts of long prompts) "
        "through the engine model under each admission policy, and report preemptions, recomputed tokens, "
        "latency in steps and utilisation. Writes metrics.json, timeline_<policy>.csv and PNG plots to --out.",
    )
    parser.add_argument("--policy", choices=(*POLICY_NAMES, "all"), default="all", help="policy to run (default all)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--out", type=Path, default=Path("results/sim_admission"), help="output folder (default results/sim_admission)"
    )
    parser.add_argument(
        "--shadow",
        action="store_true",
        help="while naive schedules, also compute what reserve_watermark would admit and report disagreements",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=DEFAULT_ENGINE.num_blocks,
        help=f"KV cache blocks (default {DEFAULT_ENGINE.num_blocks})",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_ENGINE.block_size,
        help=f"tokens per block (default {DEFAULT_ENGINE.block_size})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_ENGINE.max_num_seqs,
        help=f"sequence slots (default {DEFAULT_ENGINE.max_num_seqs})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_ENGINE.max_num_batched_tokens,
        help=f"token budget per step (default {DEFAULT_ENGINE.max_num_batched_tokens})",
    )
    parser.add_argument(
        "--headroom-fraction",
        type=float,
        default=0.125,
        help="reserve_watermark headroom, fraction of the cache (default 0.125)",
    )
    defaults = WorkloadParams()
    for name, kind, help_text in WORKLOAD_OPTIONS:
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=getattr(defaults, name),
            help=f"{help_text} (default {getattr(defaults, name)})",
        )
    parser.set_defaults(func=run_admission)


def run_admission(args: argparse.Namespace) -> int:
    policies = POLICY_NAMES if args.policy == "all" else (args.policy,)
    try:
        config = ExperimentConfig(
            engine=EngineConfig(
                num_blocks=args.num_blocks,
                block_size=args.block_size,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            ),
            workload=WorkloadParams(**{name: getattr(args, name) for name, _, _ in WORKLOAD_OPTIONS}),
            headroom_fraction=args.headroom_fraction,
            seed=args.seed,
        ).validate()
        if args.shadow and "naive" not in policies:
            raise ConfigError("--shadow shadows the naive policy: use --policy naive or --policy all")
    except ConfigError as error:
        print(f"kvgate sim admission: error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    metrics, runs = run_experiment(config, policies, shadow=args.shadow)
    elapsed = time.perf_counter() - started
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    written = [write_metrics(out, metrics)] + [write_timeline(out, run) for run in runs.values()]
    print(format_table(metrics))
    print(
        f"\n{metrics['workload']['num_requests']} requests, seed {config.seed}, "
        f"{config.engine.num_blocks} blocks x {config.engine.block_size} tokens, "
        f"{config.engine.max_num_seqs} seqs, budget {config.engine.max_num_batched_tokens} tokens/step; "
        f"simulated in {elapsed:.1f} s"
    )
    if not args.no_plots:
        plots = write_plots(out, runs, config.engine.num_blocks)
        if isinstance(plots, str):
            print(plots)
        else:
            written.extend(plots)
    print("wrote " + ", ".join(str(path) for path in written))
    return 0
