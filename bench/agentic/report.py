"""Aggregating a run into the per-mode report, comparing modes, and printing the table.

Everything here is a pure function of records and counter deltas, so the report is
tested on canned data. Definitions:

- hit rate: delta prefix-cache hits / delta queries over all replicas (tokens);
- prefilled tokens: queries - hits (prompt tokens the replicas computed);
- re-prefilled tokens: prefilled tokens an infinite cache would not have computed,
  estimated as ceiling_hit_rate * queries - hits (never below 0);
- makespan: from the first send to the end of the last attempt;
- turn latency: from a turn's first send to the end of the reply the agent used;
  TTFT: from the turn's first send to that reply's first content token;
- session completion: from a session's first send to the end of its last reply, for
  the sessions whose every turn succeeded (tool time included);
- longest wait: the longest time an attempt was held at the gate (`x-kvgate-wait-ms`);
- preemptions: attempts answered 409 (superseded at the gate) and the replicas'
  engine preemptions (`vllm:num_preemptions_total`); the simulator's recomputed
  tokens (`kvgate_sim:recomputed_tokens_total`) when it exports them;
- failed turns: turns with no successful attempt; stranded attempts: attempts that
  hit the client timeout (a waiter nobody released);
- per-turn hit rates come from the replies' `usage.prompt_tokens_details.cached_tokens`
  (the simulated replica and vLLM with `--enable-prompt-tokens-details` report it):
  `usage_hit_rate_by_bucket`, and `cold_turns_by_admission`, the later turns (index >= 2)
  that found under half their prompt cached, by the admission reason that let them in.
"""

from __future__ import annotations

from collections import Counter as Tally

from kvgate.bench.agentic.driver import AttemptRecord, TurnRecord
from kvgate.bench.agentic.scrape import Counters
from kvgate.proxy.metrics import TURN_LABELS as TURN_BUCKETS  # the report's turn buckets are the metric's
from kvgate.proxy.metrics import turn_bucket
from kvgate.simulator.percentiles import percentile


def _stats(values: list[float]) -> dict:
    return {
        "n": len(values),
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


RECOMPUTED = "kvgate_sim:recomputed_tokens_total"


def summarize_mode(
    mode: str,
    attempts: list[AttemptRecord],
    turns: list[TurnRecord],
    counters: Counters,
    makespan_s: float,
    ceiling_hit_rate: float,
    planned_turns: int,
) -> dict:
    """The report of one mode's run (see the module docstring for every definition)."""
    ok_turns = [t for t in turns if t.ok]
    by_bucket_latency: dict[str, list[float]] = {}
    by_bucket_ttft: dict[str, list[float]] = {}
    by_turn_latency: dict[int, list[float]] = {}
    for t in ok_turns:
        by_bucket_latency.setdefault(turn_bucket(t.turn), []).append(t.latency_s)
        by_turn_latency.setdefault(t.turn, []).append(t.latency_s)
        if t.ttft_s is not None:
            by_bucket_ttft.setdefault(turn_bucket(t.turn), []).append(t.ttft_s)
    reasons = Tally(a.admission for a in attempts if a.admission)
    usage_by_bucket: dict[str, list[int]] = {}
    cold_turns: Tally = Tally()
    for a in attempts:
        if not a.ok or a.cached_tokens is None or not a.prompt_tokens:
            continue
        totals = usage_by_bucket.setdefault(turn_bucket(a.turn), [0, 0])
        totals[0] += a.prompt_tokens
        totals[1] += a.cached_tokens
        if a.used and a.turn >= 2 and a.cached_tokens < 0.5 * a.prompt_tokens:
            cold_turns[a.admission or "none"] += 1
    waits = [a.wait_ms for a in attempts if a.wait_ms is not None]
    sessions: dict[int, list[TurnRecord]] = {}
    for t in turns:
        sessions.setdefault(t.session_index, []).append(t)
    completions = [
        max(t.end_s for t in ts) - min(t.start_s for t in ts) for ts in sessions.values() if all(t.ok for t in ts)
    ]
    statuses = Tally(str(a.status) for a in attempts)
    prefilled = counters.queries - counters.hits
    reprefilled = max(0.0, ceiling_hit_rate * counters.queries - counters.hits)
    return {
        "mode": mode,
        "makespan_s": makespan_s,
        "hit_rate": counters.hit_rate,
        "ceiling_hit_rate": ceiling_hit_rate,
        "hit_rate_of_ceiling": counters.hit_rate / ceiling_hit_rate if ceiling_hit_rate else None,
        "prompt_tokens_queried": counters.queries,
        "prompt_tokens_hit": counters.hits,
        "prompt_tokens_prefilled": prefilled,
        "prompt_tokens_reprefilled_est": reprefilled,
        "turns_planned": planned_turns,
        "turns_ok": len(ok_turns),
        "turns_failed": sum(1 for t in turns if not t.ok),
        "turns_not_run": planned_turns - len(turns),
        "attempts": len(attempts),
        "retries": sum(1 for a in attempts if a.attempt > 1),
        "attempt_statuses": dict(sorted(statuses.items())),
        "attempts_superseded_409": sum(1 for a in attempts if a.status == 409),
        "attempts_stranded": sum(1 for a in attempts if a.status == "timeout"),
        "engine_preemptions": counters.preemptions,
        "engine_recomputed_tokens": counters.sim.get(RECOMPUTED),
        "sim_counters": dict(sorted(counters.sim.items())),
        "turn_latency_s": _stats([t.latency_s for t in ok_turns]),
        "ttft_s": _stats([t.ttft_s for t in ok_turns if t.ttft_s is not None]),
        "session_completion_s": _stats(completions),
        "turn_latency_s_by_bucket": {b: _stats(by_bucket_latency[b]) for b in TURN_BUCKETS if b in by_bucket_latency},
        "ttft_s_by_bucket": {b: _stats(by_bucket_ttft[b]) for b in TURN_BUCKETS if b in by_bucket_ttft},
        "turn_latency_mean_s_by_turn": {str(k): sum(v) / len(v) for k, v in sorted(by_turn_latency.items())},
        "usage_hit_rate_by_bucket": {
            b: usage_by_bucket[b][1] / usage_by_bucket[b][0] for b in TURN_BUCKETS if b in usage_by_bucket
        },
        "cold_turns_by_admission": dict(sorted(cold_turns.items())),
        "admission_reasons": dict(sorted(reasons.items())),
        "admission_wait_ms": _stats(waits),
        "admission_wait_ms_total": sum(waits),
    }


def compare_to(results: dict[str, dict], baseline: str = "sticky") -> dict[str, dict]:
    """Per mode: makespan ratio and hit-rate difference against `baseline` (if it ran)."""
    base = results.get(baseline)
    if not base:
        return {}
    out = {}
    for mode, r in results.items():
        out[mode] = {
            "makespan_ratio": r["makespan_s"] / base["makespan_s"] if base["makespan_s"] else None,
            "hit_rate_delta": r["hit_rate"] - base["hit_rate"],
        }
    return out


def evaluate_targets(regime: str, results: dict[str, dict]) -> list[dict]:
    """The targets for `regime`, per kvgate mode that ran: each met or not, with the number.

    no-pressure: makespan within 5% of sticky and the same hit rate (within 1 point);
    thrash: hit rate >= 85% of the ceiling, makespan <= 0.6x sticky, no failed turn.
    """
    checks = []
    sticky = results.get("sticky")
    for mode in ("kvgate-watermark", "kvgate-working_set"):
        r = results.get(mode)
        if not r or not sticky:
            continue
        ratio = r["makespan_s"] / sticky["makespan_s"] if sticky["makespan_s"] else float("inf")
        if regime == "no-pressure":
            checks.append({"mode": mode, "target": "makespan <= 1.05x sticky", "value": ratio, "met": ratio <= 1.05})
            delta = r["hit_rate"] - sticky["hit_rate"]
            checks.append(
                {"mode": mode, "target": "hit rate = sticky (+-0.01)", "value": delta, "met": abs(delta) <= 0.01}
            )
        elif regime == "thrash":
            of_ceiling = r["hit_rate_of_ceiling"] or 0.0
            checks.append(
                {"mode": mode, "target": "hit rate >= 0.85x ceiling", "value": of_ceiling, "met": of_ceiling >= 0.85}
            )
            checks.append({"mode": mode, "target": "makespan <= 0.6x sticky", "value": ratio, "met": ratio <= 0.6})
            failed = r["turns_failed"] + r["turns_not_run"]
            checks.append({"mode": mode, "target": "no failed turn", "value": failed, "met": failed == 0})
    return checks


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: dict[str, dict], comparisons: dict[str, dict]) -> str:
    """A fixed-width table, one row per mode."""
    header = (
        f"{'mode':<16}{'hit':>7}{'/ceil':>7}{'makespan':>10}{'x sticky':>9}{'turn p50':>9}"
        f"{'turn p95':>9}{'turn p99':>9}{'sess p50':>9}{'sess p95':>9}{'ttft p50':>9}{'reprefill':>11}"
        f"{'409':>5}{'eng.pre':>8}{'failed':>7}{'wait p95':>9}{'wait max':>9}"
    )
    lines = [header, "-" * len(header)]
    for mode, r in results.items():
        cmp = comparisons.get(mode, {})
        lines.append(
            f"{mode:<16}{_fmt(r['hit_rate'], '.3f'):>7}{_fmt(r['hit_rate_of_ceiling'], '.2f'):>7}"
            f"{_fmt(r['makespan_s'], '.1f'):>9}s{_fmt(cmp.get('makespan_ratio'), '.2f'):>9}"
            f"{_fmt(r['turn_latency_s']['p50'], '.2f'):>9}{_fmt(r['turn_latency_s']['p95'], '.2f'):>9}"
            f"{_fmt(r['turn_latency_s']['p99'], '.2f'):>9}{_fmt(r['session_completion_s']['p50'], '.1f'):>9}"
            f"{_fmt(r['session_completion_s']['p95'], '.1f'):>9}"
            f"{_fmt(r['ttft_s']['p50'], '.2f'):>9}{_fmt(r['prompt_tokens_reprefilled_est'], '.0f'):>11}"
            f"{r['attempts_superseded_409']:>5}{_fmt(r['engine_preemptions'], '.0f'):>8}"
            f"{r['turns_failed'] + r['turns_not_run']:>7}{_fmt(r['admission_wait_ms']['p95'], '.0f'):>9}"
            f"{_fmt(r['admission_wait_ms']['max'], '.0f'):>9}"
        )
    return "\n".join(lines)


def format_targets(checks: list[dict]) -> str:
    return "\n".join(
        f"  {c['mode']:<16}{c['target']:<30}{c['value']:>8.3f}  {'met' if c['met'] else 'NOT met'}" for c in checks
    )


def format_markdown(results: dict[str, dict], comparisons: dict[str, dict], checks: list[dict]) -> str:
    """The table as Markdown (written to results.md, pasted into docs), then the targets."""
    lines = [
        "| mode | hit rate | of ceiling | makespan s | × sticky | turn p50 s | turn p95 s | turn p99 s | "
        "session p50 s | session p95 s | re-prefilled tokens | 409 | engine preemptions | failed turns | "
        "gate wait p95 ms | longest wait ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        cmp = comparisons.get(mode, {})
        lines.append(
            f"| {mode} | {_fmt(r['hit_rate'], '.3f')} | {_fmt(r['hit_rate_of_ceiling'], '.2f')} "
            f"| {_fmt(r['makespan_s'], '.1f')} | {_fmt(cmp.get('makespan_ratio'), '.2f')} "
            f"| {_fmt(r['turn_latency_s']['p50'], '.2f')} | {_fmt(r['turn_latency_s']['p95'], '.2f')} "
            f"| {_fmt(r['turn_latency_s']['p99'], '.2f')} | {_fmt(r['session_completion_s']['p50'], '.1f')} "
            f"| {_fmt(r['session_completion_s']['p95'], '.1f')} "
            f"| {_fmt(r['prompt_tokens_reprefilled_est'], '.0f')} | {r['attempts_superseded_409']} "
            f"| {_fmt(r['engine_preemptions'], '.0f')} | {r['turns_failed'] + r['turns_not_run']} "
            f"| {_fmt(r['admission_wait_ms']['p95'], '.0f')} | {_fmt(r['admission_wait_ms']['max'], '.0f')} |"
        )
    if checks:
        lines.append("")
        lines.extend(
            f"- {c['mode']}: {c['target']}: {c['value']:.3f}, {'met' if c['met'] else 'NOT met'}" for c in checks
        )
    return "\n".join(lines) + "\n"


# The targets on real vLLM, per regime family: (target text, test of the ratios).
# Prefill-bound model: makespan <= 0.8x sticky; tiny model (prefill nearly free):
# makespan <= 1.05x sticky. With or without finish headers alike.
def real_vllm_targets(regime: str, results: dict[str, dict]) -> list[dict]:
    """The real-vLLM targets of `regime` (vllm-prefill*, vllm-small*) per kvgate mode that ran."""
    sticky = results.get("sticky")
    if not sticky or not regime.startswith(("vllm-prefill", "vllm-small")):
        return []
    checks = []
    for mode in ("kvgate-watermark", "kvgate-working_set"):
        r = results.get(mode)
        if not r:
            continue
        ratio = r["makespan_s"] / sticky["makespan_s"] if sticky["makespan_s"] else float("inf")
        if regime.startswith("vllm-prefill"):
            checks.append({"mode": mode, "target": "makespan <= 0.8x sticky", "value": ratio, "met": ratio <= 0.8})
        else:
            checks.append({"mode": mode, "target": "makespan <= 1.05x sticky", "value": ratio, "met": ratio <= 1.05})
    return checks
