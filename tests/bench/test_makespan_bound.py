"""The least makespan any policy could take (`bench.cluster.makespan_bound`): both relaxations
by hand, the price of several replicas, and the floor that reads it on the results page.
No simulated run beating its bound: tests/bench/test_cache_bound.py (it shares their runs)."""

from __future__ import annotations

import pytest

from kvgate.bench import results_floor
from kvgate.bench.cluster.makespan_bound import StepPrice, chain_bound_s, work_bound_s
from kvgate.bench.cluster.report import format_least_makespan
from kvgate.bench.cluster.run import TurnRecord
from kvgate.simulator.config import CostModel

COST = CostModel(step_overhead_s=0.01, prefill_token_s=0.001, decode_seq_s=0.0001, context_token_s=0.0)
PRICE = StepPrice.of_engines([(COST, 1.0, 100)])


def _turn(session, number, start, end, prompt, ceiling, output, ok=True):
    return TurnRecord(session, number, start, end, None, ok, 1, "r0", None, 0.0, prompt, 0, ceiling, 0, output)


TURNS = [
    _turn(0, 1, 0.0, 1.0, prompt=20, ceiling=0, output=3),  # decodes at contexts 21 and 22
    _turn(0, 2, 5.0, 6.0, prompt=30, ceiling=16, output=1),  # 14 tokens no cache could hold; no decode step
]


def test_the_work_bound_counts_steps_by_the_contexts_decoding_in_the_cache():
    # 43 context tokens decoded in a 100-token cache: 0.43 steps' overhead at least; the
    # prefill of 20 + 14 uncacheable tokens; two decodes (the first token is the prefill's)
    assert work_bound_s(TURNS, PRICE) == pytest.approx(0.01 * 0.43 + 0.001 * 34 + 0.0001 * 2)
    # a cache of a tenth the size needs ten times the steps
    small = StepPrice.of_engines([(COST, 1.0, 10)])
    assert work_bound_s(TURNS, small) == pytest.approx(0.01 * 4.3 + 0.001 * 34 + 0.0001 * 2)
    # two replicas share the work
    two = StepPrice.of_engines([(COST, 1.0, 100), (COST, 1.0, 100)])
    assert work_bound_s(TURNS, two) == pytest.approx(work_bound_s(TURNS, PRICE) / 2)


def test_the_chain_bound_is_the_longest_sessions_turns_and_tool_calls():
    # turn 1: 3 steps and 20 tokens; the 4 s tool call; turn 2: 1 step and 14 tokens
    assert chain_bound_s(TURNS, PRICE) == pytest.approx(0.01 * 3 + 0.02 + 4.0 + 0.01 + 0.014)
    other = [_turn(1, 1, 0.0, 9.0, prompt=10, ceiling=0, output=2)]
    assert chain_bound_s(TURNS + other, PRICE) == pytest.approx(4.074)
    # a failed turn ends its session's chain: nothing after it counts
    failed = [
        _turn(0, 1, 0.0, 1.0, 20, 0, 3),
        _turn(0, 2, 5.0, 6.0, 30, 16, 0, ok=False),
        _turn(0, 3, 50.0, 51.0, 9, 0, 1),
    ]
    assert chain_bound_s(failed, PRICE) == pytest.approx(0.05)


def test_several_replicas_are_priced_at_the_cheapest_step_and_the_largest_cache():
    dear = CostModel(step_overhead_s=0.02, prefill_token_s=0.0005, decode_seq_s=0.0001, context_token_s=1e-8)
    price = StepPrice.of_engines([(COST, 2.0, 100), (dear, 1.0, 300)])
    assert (price.overhead_s, price.prefill_token_s, price.context_token_s) == (0.02, 0.0005, 0.0)
    assert (price.cache_tokens, price.replicas) == (300, 2)
    with pytest.raises(ValueError, match="at least one replica"):
        StepPrice.of_engines([])


def _floor(work_s: float, chain_s: float) -> dict:
    bounded = {"makespan_s": 100.0, "makespan_bound_s": {"work_s": work_s, "chain_s": chain_s}}
    return results_floor.floor_of(bounded, {"makespan_s": 65.0, "hit_rate": 0.9}, "trace-70b-tight")


def test_the_floor_decides_by_the_bound_over_the_rows_own_sticky_and_names_its_part():
    """Over the row's own sticky makespan (the same turns, measured) the bound above the
    target: no policy meets it, whatever an unbounded cache took; at or below, the bound
    does not rule it out, and the note says so, not that a policy reaches it."""
    chained = _floor(work_s=25.0, chain_s=62.0)
    assert (chained["bound_s"], chained["bound_by"]) == (62.0, "chain_s")
    assert chained["bound_command"] == "kvgate sim cluster --regime trace-70b-tight --policies sticky --no-plots"
    note = results_floor.floor_note(chained, 0.4, 100.0)
    assert note.startswith("no policy reaches 0.4x: the least makespan any policy could take on this cache is 62.0 s")
    assert "0.62x this row's sticky (the longest session's own turns and tool calls" in note
    assert "with every prefix kept (an unbounded cache) sticky itself takes 0.65x" in note
    # the row's sticky ran slower than the simulation's: the same 62 s is a smaller share of it
    assert results_floor.floor_note(chained, 0.4, 150.0).startswith("no policy reaches 0.4x")
    assert results_floor.floor_note(chained, 0.4, 200.0).startswith("not ruled out: ")
    with pytest.raises(ValueError, match="sticky served no turn"):
        _floor(work_s=0.0, chain_s=0.0)  # no bound to judge by: the floor says so, not 0 s
    worked = results_floor.floor_note(_floor(work_s=31.0, chain_s=5.0), 0.4, 100.0)
    assert worked.startswith("not ruled out: the least makespan any policy could take on this cache is 31.0 s")
    assert "each decoding sequence's whole context in its replica's cache" in worked


def test_a_fixed_session_runs_table_ends_with_its_least_makespan():
    """Each policy's makespan over its own bound; the line names the larger bound and its part."""
    bound = {"work_s": 26.6, "chain_s": 4.8}
    summaries = {
        "sticky": {"makespan_s": 85.8, "makespan_bound_s": bound},
        "working_set": {"makespan_s": 43.4, "makespan_bound_s": bound},
    }
    line = format_least_makespan(summaries)
    assert "Least makespan any policy could take on these replicas: 26.6 s (the replicas' steps" in line
    assert line.rstrip().endswith("sticky 3.23x, working_set 1.63x.")
    # a policy that served no turn has no bound: no line
    summaries["direct"] = {"makespan_s": 0.0, "makespan_bound_s": {"work_s": 0.0, "chain_s": 0.0}}
    assert format_least_makespan(summaries) == ""
