"""The per-mode report aggregated from canned attempts, turns and counters."""

import pytest

from kvgate.bench.agentic.driver import AttemptRecord, TurnRecord
from kvgate.bench.agentic.report import (
    compare_to,
    evaluate_targets,
    format_table,
    percentile,
    real_vllm_targets,
    summarize_mode,
    turn_bucket,
)
from kvgate.bench.agentic.scrape import Counters


def attempt(session, turn, status=200, attempt_no=1, admission="open", wait_ms=0.0, used=True, cached=None):
    return AttemptRecord(
        session, turn, attempt_no, 0.0, 1.0, 0.1, status, None, "r0", admission, wait_ms, 100, cached, used
    )


def canned():
    attempts = [
        attempt(0, 1, admission="open", wait_ms=0.0, cached=0),
        attempt(0, 2, admission="holds_window", wait_ms=10.0, cached=40),  # cold: < half cached
        attempt(1, 1, status=409, admission=None, wait_ms=None, used=False),  # superseded at the gate
        attempt(1, 1, attempt_no=2, admission="resident_prefix", wait_ms=30.0, cached=20),
        attempt(1, 2, status="timeout", admission=None, wait_ms=None, used=False),  # stranded
    ]
    turns = [
        TurnRecord(0, 1, 0.0, 1.0, 0.5, True, 1),
        TurnRecord(0, 2, 2.0, 5.0, 2.5, True, 1),
        TurnRecord(1, 1, 0.0, 2.0, None, True, 2),
        TurnRecord(1, 2, 3.0, 9.0, None, False, 1),
    ]
    counters = Counters(
        queries=1000,
        hits=600,
        preemptions=3,
        sim={"kvgate_sim:recomputed_tokens_total": 120, "kvgate_sim:preempted_prefix_cache_hits_total": 7},
    )
    return attempts, turns, counters


def test_summary_of_canned_run():
    attempts, turns, counters = canned()
    s = summarize_mode(
        "kvgate-watermark", attempts, turns, counters, makespan_s=9.5, ceiling_hit_rate=0.8, planned_turns=5
    )
    assert s["hit_rate"] == 0.6
    assert s["hit_rate_of_ceiling"] == pytest.approx(0.75)
    assert s["prompt_tokens_prefilled"] == 400
    assert s["prompt_tokens_reprefilled_est"] == pytest.approx(200)  # 0.8 * 1000 - 600
    assert (s["turns_ok"], s["turns_failed"], s["turns_not_run"]) == (3, 1, 1)
    assert (s["attempts"], s["retries"]) == (5, 1)
    assert s["attempts_superseded_409"] == 1 and s["attempts_stranded"] == 1
    assert s["attempt_statuses"] == {"200": 3, "409": 1, "timeout": 1}
    assert s["engine_preemptions"] == 3 and s["engine_recomputed_tokens"] == 120
    assert s["admission_reasons"] == {"open": 1, "holds_window": 1, "resident_prefix": 1}
    assert s["admission_wait_ms"]["p50"] == 10.0 and s["admission_wait_ms"]["max"] == 30.0
    assert s["admission_wait_ms_total"] == 40.0
    # latencies of ok turns: turn 1 -> 1.0 and 2.0; turn 2 -> 3.0 (the failed turn is left out)
    assert s["turn_latency_s_by_bucket"]["1"]["mean"] == 1.5
    assert s["turn_latency_s_by_bucket"]["2-3"]["n"] == 1
    assert s["turn_latency_mean_s_by_turn"] == {"1": 1.5, "2": 3.0}
    assert s["ttft_s_by_bucket"]["1"]["n"] == 1 and s["ttft_s"]["n"] == 2
    assert s["makespan_s"] == 9.5
    assert s["usage_hit_rate_by_bucket"] == {"1": 0.1, "2-3": 0.4}  # turn 1: 20 of 200; turn 2: 40 of 100
    assert s["cold_turns_by_admission"] == {"holds_window": 1}
    # session 0: 0.0 to 5.0; session 1 has a failed turn, so it never completed
    assert s["session_completion_s"]["n"] == 1 and s["session_completion_s"]["p95"] == 5.0
    assert s["turn_latency_s"]["p99"] == 3.0


def test_reprefilled_never_negative():
    s = summarize_mode("direct", [], [], Counters(queries=100, hits=90), 1.0, 0.5, 0)
    assert s["prompt_tokens_reprefilled_est"] == 0.0


def test_comparisons_and_targets():
    base = {"makespan_s": 10.0, "hit_rate": 0.3, "hit_rate_of_ceiling": 0.35, "turns_failed": 0, "turns_not_run": 0}
    results = {
        "sticky": base,
        "kvgate-watermark": {**base, "makespan_s": 5.0, "hit_rate": 0.8, "hit_rate_of_ceiling": 0.9},
        "kvgate-working_set": {
            **base,
            "makespan_s": 7.0,
            "hit_rate": 0.7,
            "hit_rate_of_ceiling": 0.8,
            "turns_failed": 1,
        },
    }
    cmp = compare_to(results)
    assert cmp["kvgate-watermark"]["makespan_ratio"] == 0.5
    assert cmp["kvgate-watermark"]["hit_rate_delta"] == pytest.approx(0.5)
    checks = {(c["mode"], c["target"]): c["met"] for c in evaluate_targets("thrash", results)}
    assert (
        checks[("kvgate-watermark", "hit rate >= 0.85x ceiling")]
        and checks[("kvgate-watermark", "makespan <= 0.6x sticky")]
    )
    assert checks[("kvgate-watermark", "no failed turn")]
    assert not checks[("kvgate-working_set", "hit rate >= 0.85x ceiling")]
    assert not checks[("kvgate-working_set", "makespan <= 0.6x sticky")]
    assert not checks[("kvgate-working_set", "no failed turn")]
    calm = {
        (c["mode"], c["target"]): c["met"]
        for c in evaluate_targets("no-pressure", {"sticky": base, "kvgate-watermark": {**base, "makespan_s": 10.4}})
    }
    assert calm == {
        ("kvgate-watermark", "makespan <= 1.05x sticky"): True,
        ("kvgate-watermark", "hit rate = sticky (+-0.01)"): True,
    }
    assert evaluate_targets("thrash", {"kvgate-watermark": base}) == []  # no sticky run: nothing to compare


def test_table_has_a_row_per_mode():
    attempts, turns, counters = canned()
    results = {m: summarize_mode(m, attempts, turns, counters, 9.5, 0.8, 5) for m in ("sticky", "kvgate-watermark")}
    table = format_table(results, compare_to(results))
    assert [line.split()[0] for line in table.splitlines()[2:]] == ["sticky", "kvgate-watermark"]


def test_markdown_table_has_a_row_per_mode_and_the_targets():
    from kvgate.bench.agentic.report import format_markdown

    attempts, turns, counters = canned()
    results = {m: summarize_mode(m, attempts, turns, counters, 9.5, 0.8, 5) for m in ("sticky", "kvgate-watermark")}
    text = format_markdown(results, compare_to(results), evaluate_targets("thrash", results))
    rows = [line for line in text.splitlines() if line.startswith("| sticky") or line.startswith("| kvgate")]
    assert len(rows) == 2 and "| 9.5 | 1.00 |" in rows[1]
    assert "- kvgate-watermark: no failed turn: 2.000, NOT met" in text


def test_percentile_and_buckets():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0  # nearest rank: an observed value
    assert [turn_bucket(i) for i in (1, 2, 3, 4, 7, 8, 15, 16, 40)] == [
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "8-15",
        "16+",
        "16+",
    ]


def test_median_run_picks_the_middle_makespan():
    from kvgate.bench.agentic.runner import ModeRun, median_run

    runs = [ModeRun({"makespan_s": m}, [], [], []) for m in (9.0, 3.0, 5.0, 7.0)]
    assert median_run(runs).summary["makespan_s"] == 5.0
    assert median_run(runs[:3]).summary["makespan_s"] == 5.0


@pytest.mark.parametrize(
    "regime,kvgate,expected",
    [
        # prefill-bound model: makespan <= 0.8x sticky, hit rate not a target (sticky: 10 s, 0.2)
        ("vllm-prefill", {"makespan_s": 8.0, "hit_rate": 0.2}, {"makespan <= 0.8x sticky": True}),
        ("vllm-prefill-no-finish", {"makespan_s": 8.1, "hit_rate": 0.9}, {"makespan <= 0.8x sticky": False}),
        # tiny model: makespan <= 1.05x sticky, hit rate not a target
        ("vllm-small", {"makespan_s": 10.5, "hit_rate": 0.1}, {"makespan <= 1.05x sticky": True}),
        ("vllm-small-no-finish", {"makespan_s": 10.6, "hit_rate": 0.9}, {"makespan <= 1.05x sticky": False}),
        ("thrash", {"makespan_s": 1.0, "hit_rate": 0.9}, {}),  # simulated regimes: evaluate_targets' job
    ],
)
def test_real_vllm_targets(regime, kvgate, expected):
    results = {"sticky": {"makespan_s": 10.0, "hit_rate": 0.2}, "kvgate-working_set": kvgate}
    checks = real_vllm_targets(regime, results)
    assert {c["target"]: c["met"] for c in checks} == expected
    assert all(c["mode"] == "kvgate-working_set" for c in checks)
    assert real_vllm_targets(regime, {"kvgate-working_set": kvgate}) == []  # no sticky run: nothing to compare
