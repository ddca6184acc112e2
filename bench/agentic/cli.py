"""`kvgate bench agentic`: options, and the invocation that runs the modes and writes the report.

A regime preset (`--regime`) sets the workload, the replica shape and the gate settings;
every other option overrides one of them. Output in `--out`: `results.md` (the table
in Markdown), `results.json` (the configuration, the ceiling, one summary per mode,
comparisons against `sticky`, the regime's targets met or not, the sweep),
`attempts_<mode>.jsonl` (every HTTP attempt),
`hit_rate_over_time.png`, `turn_latency_by_turn.png`, and `logs/<mode>/` (server logs
and the proxy's config). The table goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvgate.bench.agentic.apis import APIS
from kvgate.bench.agentic.ceiling import WORDS, TokenModel, simulator_token_model, workload_ceiling
from kvgate.bench.agentic.plots import write_plots
from kvgate.bench.agentic.regimes import REGIMES, Regime, get_regime, preset_shape
from kvgate.bench.agentic.remote_tokens import server_token_model
from kvgate.bench.agentic.report import (
    compare_to,
    evaluate_targets,
    format_markdown,
    format_table,
    format_targets,
    real_vllm_targets,
)
from kvgate.bench.agentic.runner import MODES, RENAMED_MODES, RunPlan, model_name, run_mode, run_plan
from kvgate.bench.agentic.sweep import DEFAULT_GRID, SWEPT_SETTINGS, best_point, format_sweep, grid_points, parse_values
from kvgate.bench.agentic.topologies import TOPOLOGY_MODES
from kvgate.bench.agentic.workload import Workload, generate_workload, workload_from_trace
from kvgate.bench.gate_options import add_gate_options, add_option_flags, gate_overrides, option_values
from kvgate.simulator.agent_trace import AgentTraceSpec, generate_trace
from kvgate.simulator.cost_presets import COST_PRESETS

# option name -> (type, help); each sets the WorkloadSpec / ReplicaShape / gate field of that name
_WORKLOAD_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {  # option: (parse, help)
    "sessions": (int, "sessions in the whole run"),
    "concurrency": (int, "sessions active at once (a rolling rollout step)"),
    "start_interval_s": (float, "session i starts no earlier than i x this (staggered arrivals)"),
    "turns_min": (int, "fewest turns of a session"),
    "turns_max": (int, "most turns of a session"),
    "system_prompt_words": (int, "system prompt length"),
    "task_words": (int, "first user message length"),
    "tool_result_words_min": (int, "shortest tool result appended per turn"),
    "tool_result_words_max": (int, "longest tool result appended per turn"),
    "reply_tokens": (int, "max_tokens of every turn (the reply length)"),
    "tool_latency_median_s": (float, "median tool latency between turns (lognormal body)"),
    "tool_latency_sigma": (float, "lognormal sigma of the tool latency"),
    "tool_tail_prob": (float, "share of tool calls in the heavy tail"),
    "tool_tail_s": (float, "a heavy-tail tool call lasts this x uniform(1, 2) seconds"),
    "retry_prob": (float, "share of turns re-sent 5-50 ms after their first attempt if unanswered"),
}
# trace regimes (trace-*): option -> AgentTraceSpec field (--sessions and --concurrency also apply)
_TRACE_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "agents": (int, "trace regimes: agents in the closed loop (sessions at once; same as --concurrency)"),
    "token_scale": (
        float,
        "trace regimes: divide every token count and the cache by this, multiply every cost by it "
        "(one scaled token stands for this many; default: the regime's)",
    ),
    "tool_time_max_s": (float, "trace regimes: clamp of the heavy-tailed tool time, seconds"),
}
_SHAPE_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "num_blocks": (int, "KV blocks per replica"),
    "block_size": (int, "tokens per block"),
    "max_num_seqs": (int, "sequence slots per replica"),
    "max_num_batched_tokens": (int, "token budget per engine step"),
    "max_model_len": (int, "longest prompt + reply"),
    "time_scale": (float, "multiplies the cost model's step times (0 = as fast as possible)"),
    "prefill_token_s": (float, "cost model: seconds per prompt token computed (default: the replica's)"),
}


def _regime_name(name: str) -> str:
    """A known regime's name; a renamed or unknown one is refused saying what to write."""
    try:
        return get_regime(name).name
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--regime",
        default="thrash",
        type=_regime_name,
        metavar="{" + ",".join(sorted(REGIMES)) + "}",
        help="preset of workload, replica shape and gate settings (default: thrash); "
        + "; ".join(f"{r.name}: {r.description}" for r in REGIMES.values()).replace("%", "%%"),
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated modes to run, in order (default: all: {','.join(MODES)}; "
        f"scale-out layouts, not in the default: {','.join(TOPOLOGY_MODES)})",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--api",
        default="chat",
        choices=APIS,
        help="the client API of every turn: chat (/v1/chat/completions, session header), "
        "messages (Anthropic /v1/messages, session in metadata.user_id as Claude Code "
        "sends it) or responses (/v1/responses chained by previous_response_id, "
        "session in prompt_cache_key); the same conversation in each (default chat)",
    )
    parser.add_argument("--out", default="results/agentic", help="output folder (default results/agentic)")
    parser.add_argument("--replicas", type=int, default=None, help="simulated replicas to start (regime default)")
    parser.add_argument(
        "--replica-url",
        action="append",
        default=[],
        metavar="URL",
        help="run against this vLLM server instead of simulated replicas (repeatable). "
        "Servers are not restarted between modes: the runner POSTs /reset_prefix_cache "
        "(vLLM needs VLLM_SERVER_DEV_MODE=1), else run one mode per invocation",
    )
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds before an attempt counts as stranded (default 300)",
    )
    parser.add_argument(
        "--sample-interval",
        type=float,
        default=1.0,
        help="seconds between counter samples for the hit-rate plot (default 1)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of all modes (interleaved); each mode reports its median-makespan "
        "round and lists every round (default 1)",
    )
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    work = parser.add_argument_group("workload (overrides the regime; lengths in words ~ tokens)")
    add_option_flags(work, _WORKLOAD_OPTIONS, "w_")
    work.add_argument(
        "--send-finish",
        choices=("yes", "no"),
        default=None,
        help="whether the last turn carries x-session-finish (no: sessions end silently, "
        "as an OpenAI-SDK agent's do; default: the regime's)",
    )
    work.add_argument(
        "--shared-system-prompt",
        choices=("yes", "no"),
        default=None,
        help="one system prompt for all sessions (yes) or one each (no)",
    )
    trace = parser.add_argument_group("agent trace workload (trace-* regimes)")
    for name, (kind, text) in _TRACE_OPTIONS.items():
        trace.add_argument(
            "--" + name.replace("_", "-"), type=kind, default=None, dest="t_" + name, help=text, metavar="X"
        )
    shape = parser.add_argument_group("simulated replicas (overrides the regime; `kvgate replica` options)")
    shape.add_argument(
        "--cost-preset",
        choices=sorted(COST_PRESETS),
        default=None,
        help="replicas from a GPU-calibrated preset (cache, scheduler shape, step cost), coarsened by "
        "--token-scale; " + "; ".join(f"{p.name}: {p.description}" for p in COST_PRESETS.values()).replace("%", "%%"),
    )
    add_option_flags(shape, _SHAPE_OPTIONS, "r_")
    add_gate_options(
        parser, "gate settings for the kvgate modes (overrides the regime; docs/reference.md, Configuration)"
    )
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--sweep",
        action="store_true",
        help="run sticky once, then every kvgate mode of --modes over a grid of "
        "high_watermark x hit_threshold x idle_grace_sec (x headroom_blocks), and print the best settings",
    )
    for name in SWEPT_SETTINGS:
        sweep.add_argument(
            "--sweep-" + name.replace("_", "-"),
            default=None,
            dest="s_" + name,
            help=f"comma-separated values (default {','.join(map(str, DEFAULT_GRID[name]))})",
        )
    return parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `agentic` subcommand under `kvgate bench`."""
    parser = subparsers.add_parser(
        "agentic",
        help="the multi-turn agentic benchmark: direct vs sticky vs kvgate (docs/bench.md)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    parser.set_defaults(func=main)
    return parser


def _workload(args, regime: Regime) -> tuple[Workload, float]:
    """The run's workload (regime + overrides) and its token scale (1 for word workloads)."""
    if isinstance(regime.workload, AgentTraceSpec):
        unsupported = sorted(set(option_values(args, _WORKLOAD_OPTIONS, "w_")) - {"sessions", "concurrency"})
        if unsupported or args.shared_system_prompt is not None:
            raise ValueError(
                f"regime {regime.name} is an agent trace: {unsupported or ['shared_system_prompt']} do not apply "
                "(use --sessions, --agents, --token-scale, --tool-time-max-s)"
            )
        changes = option_values(args, _TRACE_OPTIONS, "t_")
        if args.w_sessions is not None:
            changes["sessions"] = args.w_sessions
        if args.w_concurrency is not None:
            changes.setdefault("agents", args.w_concurrency)
        time_scale = args.r_time_scale if args.r_time_scale is not None else regime.shape.time_scale
        trace = regime.workload.replace(**changes, time_scale=time_scale)
        send_finish = regime.send_finish if args.send_finish is None else args.send_finish == "yes"
        return workload_from_trace(generate_trace(trace, args.seed), send_finish), trace.token_scale
    if any(getattr(args, "t_" + name) is not None for name in _TRACE_OPTIONS):
        raise ValueError(f"--agents, --token-scale and --tool-time-max-s need a trace-* regime, not {regime.name}")
    spec = regime.workload.replace(**option_values(args, _WORKLOAD_OPTIONS, "w_"))
    if args.shared_system_prompt is not None:
        spec = spec.replace(shared_system_prompt=args.shared_system_prompt == "yes")
    if args.send_finish is not None:
        spec = spec.replace(send_finish=args.send_finish == "yes")
    return generate_workload(spec, args.seed), 1.0


def build_plan(args) -> tuple[RunPlan, str]:
    """The run plan of parsed `args` (regime preset + overrides); raises ValueError on bad options."""
    regime = get_regime(args.regime)
    workload, token_scale = _workload(args, regime)
    shape = regime.shape if args.replica_url else regime.simulated_shape()  # given servers: their own shape
    preset = args.cost_preset or regime.cost_preset
    if preset is not None:
        shape = preset_shape(preset, token_scale, shape.time_scale, regime.kv_fraction)
    shape = replace(shape, **option_values(args, _SHAPE_OPTIONS, "r_"))
    settings = {**regime.gate, **gate_overrides(args)}
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    renamed = [f"{m!r} is now {RENAMED_MODES[m]!r}" for m in modes if m in RENAMED_MODES]
    if renamed:
        raise ValueError(f"--modes: {'; '.join(renamed)} (see CHANGELOG.md)")
    unknown = [m for m in modes if m not in MODES + TOPOLOGY_MODES]
    if unknown or not modes:
        raise ValueError(f"--modes: unknown {unknown or 'empty'}; choose from {', '.join(MODES + TOPOLOGY_MODES)}")
    if args.repeat < 1:
        raise ValueError("--repeat must be >= 1")
    replicas = args.replicas if args.replicas is not None else regime.replicas
    if replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if workload.spec.max_tokens is not None and args.api != "chat":
        raise ValueError(f"regime {regime.name} sends a max_tokens cap, which only --api chat can (got {args.api})")
    plan = RunPlan(
        workload=workload,
        modes=modes,
        out_dir=Path(args.out),
        shape=shape,
        num_replicas=replicas,
        replica_urls=tuple(u.rstrip("/") for u in args.replica_url),
        gate_settings=settings,
        model=args.model,
        request_timeout_s=args.request_timeout,
        sample_interval_s=args.sample_interval,
        api=args.api,
        cost_preset=preset,
        token_scale=token_scale,
    )
    return plan, regime.name


def main(args) -> int:
    try:
        plan, regime = build_plan(args)
    except ValueError as exc:
        print(f"kvgate bench agentic: {exc}", file=sys.stderr)
        return 2
    if plan.replica_urls and args.sweep:
        print(
            "kvgate bench agentic: --sweep needs fresh replicas per point; it runs on simulated "
            "replicas only (drop --replica-url)",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(_run(args, plan, regime))
    except RuntimeError as exc:  # a server that would not start or answer: the message names it
        print(f"kvgate bench agentic: {exc}", file=sys.stderr)
        return 1


async def _run(args, plan: RunPlan, regime: str) -> int:
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    token_model = await _token_model(plan)
    ceiling = workload_ceiling(plan.workload, plan.block_size, token_model)
    spec = plan.workload.spec
    print(
        f"[agentic] regime {regime}, api {plan.api}, seed {plan.workload.seed}: {spec.sessions} sessions "
        f"({spec.concurrency} at once), {plan.workload.num_turns} turns; ceiling hit rate "
        f"{ceiling.hit_rate:.3f} ({token_model.name} tokens)"
    )
    started = time.time()
    runs = await run_plan(plan, ceiling.hit_rate, repeat=args.repeat)
    results = {mode: run.summary for mode, run in runs.items()}
    comparisons = compare_to(results)
    targets = evaluate_targets(regime, results) + real_vllm_targets(regime, results)
    timelines = {mode: run.timeline for mode, run in runs.items()}
    document = {
        "regime": regime,
        "api": plan.api,
        "seed": plan.workload.seed,
        "command": " ".join(sys.argv),
        "started_unix": started,
        "workload": asdict(spec),
        "cost_preset": plan.cost_preset,
        "token_scale": plan.token_scale,
        "replicas": list(plan.replica_urls) or {"count": plan.num_replicas, "shape": plan.shape.to_json()},
        "gate_settings": plan.gate_settings,
        "ceiling": {
            "hit_rate": ceiling.hit_rate,
            "prompt_tokens": ceiling.prompt_tokens,
            "hit_tokens": ceiling.hit_tokens,
            "token_model": token_model.name,
        },
        "modes": results,
        "vs_sticky": comparisons,
        "targets": targets,
        "timelines": timelines,
    }
    for mode, run in runs.items():
        with open(plan.out_dir / f"attempts_{mode}.jsonl", "w") as f:
            for a in run.attempts:
                f.write(json.dumps(a.to_json()) + "\n")
    print()
    print(format_table(results, comparisons))
    if targets:
        print(f"\ntargets ({regime}):")
        print(format_targets(targets))
    (plan.out_dir / "results.json").write_text(json.dumps(document, indent=2))
    (plan.out_dir / "results.md").write_text(format_markdown(results, comparisons, targets))
    if args.sweep:  # minutes more: the modes' results are already on disk
        document["sweep"] = await _sweep(args, plan, ceiling.hit_rate, results.get("sticky"))
        (plan.out_dir / "results.json").write_text(json.dumps(document, indent=2))
    if not args.no_plots:
        write_plots(results, timelines, plan.out_dir)
    print(f"\n[agentic] wrote {plan.out_dir / 'results.json'}")
    return 0


async def _token_model(plan: RunPlan) -> TokenModel:
    """The simulator's tokenizer for simulated replicas; the server's /tokenize for given URLs."""
    if not plan.replica_urls:
        return simulator_token_model() or WORDS
    import aiohttp

    url = plan.replica_urls[0]
    try:
        async with aiohttp.ClientSession() as http:
            name = plan.model or await model_name(http, url)
            return await server_token_model(http, url, name, plan.workload)
    except (TimeoutError, RuntimeError, aiohttp.ClientError, KeyError) as exc:
        print(f"[agentic] {url}/tokenize unusable ({exc!r}); the ceiling uses the words estimate")
        return WORDS


async def _sweep(args, plan: RunPlan, ceiling_rate: float, sticky: dict | None) -> dict:
    grid = {
        k: (parse_values(getattr(args, "s_" + k), k) if getattr(args, "s_" + k) else DEFAULT_GRID[k])
        for k in SWEPT_SETTINGS
    }
    if sticky is None:
        print("[agentic] sweep: running sticky once as the baseline")
        sticky = (await run_mode(plan, "sticky", ceiling_rate)).summary
    baseline = sticky["makespan_s"]
    out = {"grid": grid, "baseline_sticky_makespan_s": baseline, "modes": {}}
    for mode in (m for m in plan.modes if m.startswith("kvgate")):
        rows = []
        for settings in grid_points(grid):
            point_plan = replace(plan, gate_settings={**plan.gate_settings, **settings})
            s = (await run_mode(point_plan, mode, ceiling_rate)).summary
            rows.append(
                {
                    "settings": settings,
                    "makespan_s": s["makespan_s"],
                    "hit_rate": s["hit_rate"],
                    "failed": s["turns_failed"] + s["turns_not_run"],
                }
            )
            print(f"[agentic] sweep {mode} {settings}: hit {s['hit_rate']:.3f}, makespan {s['makespan_s']:.1f}s")
        print(format_sweep(mode, rows, baseline))
        out["modes"][mode] = {"rows": rows, "best": best_point(rows)}
    return out
