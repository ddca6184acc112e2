"""A run's figures, the table comparing policies, and the replica sweep's answer.

Pure functions of the run records. Definitions (as `kvgate bench agentic`'s report):
- makespan: from the first turn's send to the last turn's end;
- throughput: completed turns, generated tokens and prompt tokens per second of makespan;
- hit rate: prompt tokens not recomputed over prompt tokens, counted by the engines at each
  request's first admission: GPU prefix-cache hits (vLLM's `prefix_cache_hits/queries`)
  plus, with a CPU tier, tokens loaded from it (`cpu_hit_rate`; `gpu_hit_rate` is the
  GPU part alone); ceiling: what an infinite prefix cache would hit on the same turns
  (`TurnRecord.ceiling_tokens`); the most of it the run's caches could hold at all,
  with foresight of tool-call lengths or without (`cache_bound`);
- turn latency: from a turn's first send to its end (gate wait, queueing, prefill and
  decode; retries of a failed attempt included); TTFT: to its first token; later turns'
  latency leaves out each session's first turn (a run whose agents all start at once
  has its cold start there);
- session completion: from a session's first send to its last turn's end (completed
  sessions only);
- balance: per replica, completed turns and busy time (engine step time) over the
  mean across replicas (1.0 is perfectly even).
Percentiles are nearest rank (`simulator.percentiles`).
"""

from __future__ import annotations

from collections import Counter

from kvgate.bench.cluster.cache_bound import hit_bounds
from kvgate.bench.cluster.makespan_bound import BOUND_PARTS, least_makespan, makespan_bound
from kvgate.bench.cluster.run import RunResult
from kvgate.simulator.percentiles import percentile


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _stats(values: list[float]) -> dict:
    return {
        "n": len(values),
        "mean": _round(sum(values) / len(values)) if values else None,
        "p50": _round(percentile(values, 50)),
        "p95": _round(percentile(values, 95)),
        "p99": _round(percentile(values, 99)),
        "max": _round(max(values)) if values else None,
    }


def summarize(result: RunResult) -> dict:
    """One policy's figures (see the module docstring)."""
    turns = result.turns
    ok = [t for t in turns if t.ok]
    first = min((t.start_s for t in turns), default=0.0)
    makespan = result.end_s - first
    queries = hits = cpu_hits = generated = preemptions = recomputed = evictions = pin_yields = 0
    tiered = False
    busy: dict[str, float] = {}
    for name, engine in result.engines.items():
        stats = engine.scheduler.kv_cache_manager.prefix_cache_stats
        queries += stats.queries
        hits += stats.hits
        cpu_hits += stats.cpu_hits
        tiered = tiered or engine.scheduler.kv_cache_manager.cpu_tier is not None
        counters = engine.scheduler.counters
        generated += counters.num_generation_tokens
        preemptions += counters.num_preemptions
        recomputed += counters.num_recomputed_tokens
        evictions += engine.scheduler.kv_cache_manager.block_pool.num_evictions
        pin_yields += engine.scheduler.kv_cache_manager.pins.num_yields
        busy[name] = engine.busy_sec
    prompt_tokens = sum(t.prompt_tokens for t in ok)
    ceiling_tokens = sum(t.ceiling_tokens for t in ok)
    gpu_hit_rate = hits / queries if queries else 0.0
    hit_rate = (hits + cpu_hits) / queries if queries else 0.0
    ceiling = ceiling_tokens / prompt_tokens if prompt_tokens else 0.0
    per_turns = result.replica_turns
    mean_turns = sum(per_turns.values()) / len(per_turns) if per_turns else 0.0
    mean_busy = sum(busy.values()) / len(busy) if busy else 0.0
    sessions = [s.end_s - s.start_s for s in result.sessions if s.completed]
    reasons = Counter(t.admission for t in ok if t.admission)
    return {
        "policy": result.policy,
        "makespan_s": _round(makespan),
        "turns_ok": len(ok),
        "turns_failed": len(turns) - len(ok),
        "failed_attempts": result.failed_attempts,
        "sessions_started": len(result.sessions),
        "sessions_completed": len(sessions),
        "turns_per_s": _round(len(ok) / makespan if makespan else 0.0),
        # in real tokens: a coarsened run's token stands for `token_scale` of them
        "generated_tokens_per_s": _round(generated * result.token_scale / makespan if makespan else 0.0, 1),
        "prompt_tokens_per_s": _round(queries * result.token_scale / makespan if makespan else 0.0, 1),
        "hit_rate": _round(hit_rate),
        "ceiling_hit_rate": _round(ceiling),
        "hit_rate_of_ceiling": _round(hit_rate / ceiling if ceiling else None),
        "hit_rate_bound_of_ceiling": hit_bounds(ok, result.engines.values(), makespan),
        "makespan_bound_s": makespan_bound(turns, result.engines.values()),
        "gpu_hit_rate": _round(gpu_hit_rate),
        "gpu_hit_rate_of_ceiling": _round(gpu_hit_rate / ceiling if ceiling else None),
        "cpu_hit_rate": _round(cpu_hits / queries if queries else 0.0) if tiered else None,
        "prompt_tokens_prefilled": queries - hits - cpu_hits,
        "engine_preemptions": preemptions,
        "recomputed_tokens": recomputed,
        "evictions": evictions,
        "pin_yields": pin_yields,  # KV pins the engines released to fit a request (gate.pins)
        "relocated_turns": result.relocated_turns,  # held turns moved to an idle replica (gate.relocate_held)
        # held newcomers by whether waiting gave them a window; windows ended by cause (no gate: empty)
        "held_turns": result.gate_counts.get("held_turns", {}),
        "window_ends": result.gate_counts.get("window_ends", {}),
        "turn_latency_s": _stats([t.end_s - t.start_s for t in ok]),
        "later_turn_latency_s": _stats([t.end_s - t.start_s for t in ok if t.turn > 1]),
        "ttft_s": _stats([t.ttft_s for t in ok if t.ttft_s is not None]),
        "session_completion_s": _stats(sessions),
        "gate_wait_ms": _stats([t.wait_ms for t in ok]),
        "admission_reasons": dict(sorted(reasons.items())),
        "balance": {
            "turns_max_over_mean": _round(max(per_turns.values()) / mean_turns if mean_turns else None),
            "turns_min_over_mean": _round(min(per_turns.values()) / mean_turns if mean_turns else None),
            "busy_max_over_mean": _round(max(busy.values()) / mean_busy if mean_busy else None),
            "busy_min_over_mean": _round(min(busy.values()) / mean_busy if mean_busy else None),
        },
        "replicas": {
            name: {"turns": per_turns.get(name, 0), "busy_s": _round(busy[name], 3)} for name in result.engines
        },
        "events": [[_round(at, 3), what] for at, what in result.events],
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(summaries: dict[str, dict]) -> str:
    """One Markdown row per policy; with a CPU tier, two more columns: the GPU part of the hit
    rate (the hit rate counts CPU-tier loads) and its share of the ceiling."""
    tiered = any(s.get("cpu_hit_rate") is not None for s in summaries.values())
    lines = [
        "| policy | makespan s | × sticky | turns/s | gen tok/s | hit rate | of ceiling | turn p50 s | turn p95 s "
        "| ttft p95 s | session p95 s | busy max/mean | failed turns |"
        + (" gpu hit | gpu of ceiling |" if tiered else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if tiered else ""),
    ]
    sticky = summaries.get("sticky")
    for policy, s in summaries.items():
        ratio = s["makespan_s"] / sticky["makespan_s"] if sticky and sticky["makespan_s"] else None
        lines.append(
            f"| {policy} | {_fmt(s['makespan_s'], '.1f')} | {_fmt(ratio, '.2f')} | {_fmt(s['turns_per_s'], '.2f')} "
            f"| {_fmt(s['generated_tokens_per_s'], '.0f')} | {_fmt(s['hit_rate'], '.3f')} "
            f"| {_fmt(s['hit_rate_of_ceiling'], '.2f')} | {_fmt(s['turn_latency_s']['p50'], '.2f')} "
            f"| {_fmt(s['turn_latency_s']['p95'], '.2f')} | {_fmt(s['ttft_s']['p95'], '.2f')} "
            f"| {_fmt(s['session_completion_s']['p95'], '.1f')} | {_fmt(s['balance']['busy_max_over_mean'], '.2f')} "
            f"| {s['turns_failed']} |"
            + (f" {_fmt(s['gpu_hit_rate'], '.3f')} | {_fmt(s['gpu_hit_rate_of_ceiling'], '.2f')} |" if tiered else "")
        )
    return "\n".join(lines) + "\n"


def format_least_makespan(summaries: dict[str, dict]) -> str:
    """A line under a fixed-session run's table: the least makespan any policy could take on
    these replicas, and each policy's makespan over it ("" without one)."""
    bounds = {}
    for policy, summary in summaries.items():
        least = least_makespan(summary)
        if least is None:
            return ""
        bounds[policy] = least
    if not bounds:
        return ""
    seconds, part = max(bounds.values())
    over = ", ".join(f"{policy} {s['makespan_s'] / bounds[policy][0]:.2f}x" for policy, s in summaries.items())
    return (
        f"\nLeast makespan any policy could take on these replicas: {seconds:.1f} s ({BOUND_PARTS[part]}; "
        f"`makespan_bound_s`, docs/cluster.md). Each policy's makespan over its own: {over}.\n"
    )


def sweep_answer(
    sweep: dict[int, dict[str, dict]], p95_target_s: float | None, latency: str = "turn_latency_s"
) -> dict[str, int | None]:
    """Per policy: the fewest replicas whose turn-latency p95 (`latency`: of every turn, or
    `later_turn_latency_s`) is within the target (None: none was, or none was measured)."""
    answer: dict[str, int | None] = {}
    if p95_target_s is None:
        return answer
    policies = sorted({policy for results in sweep.values() for policy in results})
    for policy in policies:
        fits = [
            replicas
            for replicas, results in sorted(sweep.items())
            if policy in results
            and (results[policy].get(latency) or {}).get("p95") is not None
            and results[policy][latency]["p95"] <= p95_target_s
            and results[policy]["turns_failed"] == 0
        ]
        answer[policy] = fits[0] if fits else None
    return answer


def format_sweep(sweep: dict[int, dict[str, dict]], p95_target_s: float | None) -> str:
    """Replicas x policy: turn p95 (s; in brackets, of the later turns: `summarize`), hit
    rate, turns/s; then the answer for the target, of every turn and of the later ones."""
    policies = sorted({policy for results in sweep.values() for policy in results})
    header = "| replicas | " + " | ".join(f"{p} p95 s (later turns) / hit / turns/s" for p in policies) + " |"
    lines = [header, "|---|" + "---|" * len(policies)]
    for replicas, results in sorted(sweep.items()):
        cells = []
        for policy in policies:
            s = results.get(policy)
            later = (s or {}).get("later_turn_latency_s") or {}
            cells.append(
                "-"
                if s is None
                else f"{_fmt(s['turn_latency_s']['p95'], '.2f')} ({_fmt(later.get('p95'), '.2f')}) "
                f"/ {_fmt(s['hit_rate'], '.3f')} / {_fmt(s['turns_per_s'], '.1f')}"
            )
        lines.append(f"| {replicas} | " + " | ".join(cells) + " |")
    answer = sweep_answer(sweep, p95_target_s)
    later = sweep_answer(sweep, p95_target_s, "later_turn_latency_s")
    if answer:
        lines.append("")
        for policy, needed in answer.items():
            lines.append(
                f"- {policy}: turn p95 <= {p95_target_s:g} s needs {_replicas(needed)}; "
                f"of the later turns, {_replicas(later.get(policy))}"
            )
    return "\n".join(lines) + "\n"


def _replicas(needed: int | None) -> str:
    return f"{needed} replicas" if needed is not None else "more replicas than swept"
