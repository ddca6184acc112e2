"""The results page: targets, limiting factors and the page are pure functions of stored rows."""

import argparse
import json
import sys

import pytest

from kvgate.bench import (
    results_cluster_targets,
    results_floor,
    results_overhead,
    results_page,
    results_pins,
    results_router,
)
from kvgate.bench.agentic.regimes import REGIMES
from kvgate.bench.cluster import report
from kvgate.bench.results_page import (
    ROWS,
    Check,
    ResultRow,
    evaluate,
    limiting_factor,
    record_of,
    render,
    round_by_round,
    selected_rows,
)


def summary(makespan=10.0, hit=0.9, ceiling=0.95, prefilled=1000, p99=1.0, mean=0.5, session_p95=20.0, wait_max=0.0):
    return {
        "makespan_s": makespan,
        "hit_rate": hit,
        "ceiling_hit_rate": ceiling,
        "hit_rate_of_ceiling": hit / ceiling,
        "prompt_tokens_prefilled": prefilled,
        "turn_latency_s": {"p50": 0.2, "p95": 0.8, "p99": p99, "mean": mean},
        "session_completion_s": {"p50": 10.0, "p95": session_p95},
        "admission_wait_ms": {"max": wait_max, "p95": 0.0},
        "admission_wait_ms_total": wait_max * 3,
        "turns_failed": 0,
        "turns_not_run": 0,
        "rounds": [],
    }


def test_simulated_targets_met_and_missed():
    sticky = summary()
    met = evaluate(("makespan<=1.02x", "session_p95<=sticky"), summary(makespan=10.1, session_p95=19.0), sticky)
    assert [c.met for c in met] == [True, True]
    missed = evaluate(("makespan<=1.02x", "session_p95<=sticky"), summary(makespan=10.5, session_p95=21.0), sticky)
    assert [c.met for c in missed] == [False, False] and missed[0].value == "1.050x"
    assert evaluate(("makespan<=0.4x",), summary(makespan=3.9), sticky)[0].met


def test_tail_target_only_where_the_gate_held():
    sticky = summary(p99=2.0, mean=1.0)
    assert evaluate(("tail_if_held",), summary(p99=9.0, wait_max=50.0), sticky) == []
    held = evaluate(("tail_if_held",), summary(p99=2.9, mean=0.8, wait_max=4000.0), sticky)
    assert held[0].met and held[0].value == "p99 1.45x, mean 0.80x"
    slow_mean = evaluate(("tail_if_held",), summary(p99=2.9, mean=1.1, wait_max=4000.0), sticky)
    assert not slow_mean[0].met
    with pytest.raises(ValueError):
        evaluate(("fast",), sticky, sticky)


def test_limiting_factor_names_slow_prefix_probes():
    """Real vLLM answers a prefix probe between two engine steps: probes that slow are a limit."""
    sticky, missed = summary(hit=0.2), [Check("t", "1", False)]
    slow = summary() | {"gate_probes": {"prefix": {"count": 83.0, "seconds": 4.15}, "kv": {"count": 9, "seconds": 1}}}
    assert "prefix probes: 83, 50 ms each" in limiting_factor(missed, slow, sticky)
    quick = summary() | {"gate_probes": {"prefix": {"count": 300.0, "seconds": 0.6}}}
    assert "prefix probes" not in limiting_factor(missed, quick, sticky)
    assert "prefix probes" not in limiting_factor(missed, summary() | {"gate_probes": {}}, sticky)
    assert limiting_factor([Check("t", "1", True)], slow, sticky) == ""


def test_limiting_factor_names_waits_lost_hits_or_the_path():
    sticky = summary(hit=0.3, prefilled=5000)
    assert limiting_factor([Check("t", "1", True)], summary(), sticky) == ""
    missed = [Check("t", "1", False)]
    assert "gate waits" in limiting_factor(missed, summary(wait_max=5000.0), sticky)
    assert "hit rate 0.50" in limiting_factor(missed, summary(hit=0.5), sticky)
    assert "nothing to win" in limiting_factor(missed, summary(), summary())
    assert "own cost" in limiting_factor(missed, summary(), sticky)


def _rounds(*makespans: float) -> list[dict]:
    return [{"makespan_s": m, "hit_rate": 0.1, "turns_failed": 0} for m in makespans]


def test_a_missed_makespan_target_shows_its_rounds_side_by_side():
    """The modes run interleaved: each gate round over the sticky round beside it, lowest to
    highest, and how many met the tightest missed target: a miss within the rounds' spread
    (some pairs meet it) reads apart from one outside it (none does)."""
    sticky = summary(makespan=2.0) | {"rounds": _rounds(2.0, 1.8, 2.2, 2.0)}
    gate = summary(makespan=2.2) | {"rounds": _rounds(2.2, 1.8, 2.2, 2.4)}
    checks = evaluate(("makespan<=1.05x",), gate, sticky)
    assert not checks[0].met
    spread = "round by round, each gate round over the sticky round run beside it: 1.00-1.20x, 2 of 4 within 1.05x"
    assert round_by_round(checks, gate, sticky) == spread
    assert limiting_factor(checks, gate, sticky).endswith("; " + spread)  # after the causes
    dear = evaluate(
        ("makespan<=1.02x", "makespan<=0.4x"),
        summary(makespan=1.0, hit=0.5) | {"rounds": _rounds(1.0, 0.9, 1.1)},
        sticky,
    )
    assert round_by_round(dear, summary() | {"rounds": _rounds(1.0, 0.9, 1.1)}, sticky).endswith("0 of 3 within 0.4x")
    assert round_by_round(evaluate(("makespan<=1.05x",), gate | {"makespan_s": 2.0}, sticky), gate, sticky) == ""  # met
    two = summary(makespan=2.2) | {"rounds": _rounds(2.2, 2.2)}
    assert round_by_round(evaluate(("makespan<=1.05x",), two, sticky), two, sticky) == ""  # too few pairs
    assert "round by round" not in limiting_factor([Check("session p95 <= sticky", "1.1x", False)], gate, sticky)


def _sim_sticky(makespan_s: float, work_s: float, chain_s: float) -> dict:
    """Sticky's summary of a floor's run on the regime's cache, with its makespan bound."""
    return {"makespan_s": makespan_s, "makespan_bound_s": {"work_s": work_s, "chain_s": chain_s}}


def test_a_missed_makespan_target_names_whether_any_policy_could_meet_it():
    """A row's floor (`results_floor`): the least makespan any policy could take over the row's
    sticky above its target: no policy reaches it; at or below: the bound does not rule it out."""
    sticky, gate = summary(makespan=200.0, hit=0.04), summary(makespan=81.0, hit=0.4)
    checks = evaluate(("makespan<=1.02x", "makespan<=0.4x"), gate, sticky)
    assert [c.allowed_x for c in checks] == [1.02, 0.4]
    unbounded = {"makespan_s": 111.6, "hit_rate": 0.94}
    dear = results_floor.floor_of(_sim_sticky(171.8, 43.8, 106.2), unbounded, "trace-70b-tight")
    assert dear["makespan_x"] == 0.65 and "--num-blocks 1000000" in dear["command"]
    assert (dear["bound_s"], dear["bound_by"]) == (106.2, "chain_s")
    unreachable = limiting_factor(checks, gate, sticky, dear)
    assert unreachable.startswith(
        "no policy reaches 0.4x: the least makespan any policy could take on this cache is 106.2 s"
    )
    assert "0.53x this row's sticky" in unreachable  # over the row's own sticky, not the simulation's
    assert "with every prefix kept (an unbounded cache) sticky itself takes 0.65x" in unreachable
    assert "hit rate 0.40" in unreachable  # and what the gate won back, as without a floor
    cheap = results_floor.floor_of(_sim_sticky(171.8, 43.8, 60.0), unbounded, "trace-70b-tight")
    assert limiting_factor(checks, gate, sticky, cheap).startswith("not ruled out: ")
    # only a target below sticky's makespan meets the floor
    assert "every prefix" not in limiting_factor(checks[:1], gate, sticky, dear)
    assert [row.key for row in ROWS if row.needs_floor] == [
        "prefill-bound",
        "prefill-bound-no-finish",
        "prefill-bound --work-conserving no",
        "prefill-bound-no-finish --work-conserving no",
        "trace-70b-tight",
        "vllm-prefill --pinning pinned",  # its simulation stands for the measured server
        "vllm-prefill-no-finish --pinning pinned",
        "vllm-prefill-capped --pinning pinned",
        "vllm-prefill --pinning pinned --work-conserving no",
        "vllm-prefill-no-finish --pinning pinned --work-conserving no",
    ]
    assert not dear["of_server"] and "of this vLLM server" not in unreachable


def test_a_real_vllm_rows_floor_says_it_simulates_that_server():
    unbounded = {"makespan_s": 6.3, "hit_rate": 0.70}
    floor = results_floor.floor_of(_sim_sticky(13.3, 4.8, 3.1), unbounded, "vllm-prefill-no-finish")
    assert floor["of_server"] and floor["makespan_x"] == 0.474
    note = results_floor.floor_note(floor, 0.8, 13.3)
    assert note.startswith(
        "not ruled out: the least makespan any policy could take on this cache is 4.8 s in the cluster "
        "simulation of this vLLM server (its measured steps and tokenizer"
    )
    assert "with every prefix kept (an unbounded cache) sticky itself" in note
    assert (
        "`kvgate sim cluster --regime vllm-prefill-no-finish --policies sticky,working_set --no-plots --num-blocks"
        in note
    )


def test_a_floor_the_gates_placement_reaches_says_so():
    """On an unbounded cache the gate holds nothing, but it still places new sessions evenly: where
    that runs faster than sticky, the floor is the gate's, and its note says whose it is."""
    floor = results_floor.floor_of(
        _sim_sticky(85.8, 26.6, 4.8), {"makespan_s": 17.2, "hit_rate": 0.85}, "prefill-bound", "working_set"
    )
    note = results_floor.floor_note(floor, 0.4, 85.8)
    assert floor["makespan_x"] == 0.2 and floor["unbounded_policy"] == "working_set"
    assert "with every prefix kept (an unbounded cache) the gate, placing sessions, takes 0.20x sticky's" in note


@pytest.mark.bench_runs
def test_the_floor_runs_both_simulations_of_a_regime(tmp_path):
    """The real `kvgate sim cluster`, twice, on the `tiny` regime (a second each)."""
    floor = results_floor.run_floor("tiny", results_page.REPO)
    assert floor is not None and 0 < floor["makespan_x"] <= 1.0
    assert 0 < floor["bound_s"] <= floor["sticky_makespan_s"] and floor["bound_by"] in ("work_s", "chain_s")
    assert floor["unbounded_makespan_s"] <= floor["sticky_makespan_s"]
    assert floor["command"] == (
        "kvgate sim cluster --regime tiny --policies sticky,working_set --no-plots --num-blocks 1000000"
    )
    assert floor["unbounded_policy"] in ("sticky", "working_set")
    assert results_floor.run_floor("no-such-regime", results_page.REPO) is None


def test_a_sweep_is_judged_by_the_replicas_the_gate_needs_and_names_its_floor():
    floor_options = results_floor.sweep_floor_options(
        ("--regime", "fleet", "--replicas", "4,8", "--policies", "sticky,working_set", "--p95", "2", "--cpu-tier", "4")
    )
    assert floor_options == [
        "--regime", "fleet", "--replicas", "4,8", "--p95", "2", "--policies", "sticky", "--no-plots",
        "--num-blocks", "1000000",
    ]  # fmt: skip
    floor = {"replicas": 12, "command": "kvgate sim cluster ..."}
    (missed,) = results_cluster_targets.sweep_targets({"sticky": 12, "working_set": 12}, 8, floor)
    assert "on at most 8 replicas and on fewer than sticky: 12 (sticky 12) **missed**" in missed
    assert "limited by: no policy meets it: with every prefix kept (an unbounded cache) sticky needs 12" in missed
    (reachable,) = results_cluster_targets.sweep_targets({"sticky": 16, "working_set": 16}, 12, floor)
    assert "16 (sticky 16) **missed**; limited by: within reach of a policy" in reachable
    (met,) = results_cluster_targets.sweep_targets({"sticky": 16, "working_set": 12}, 12, floor)
    assert met.endswith("**met**")
    (none,) = results_cluster_targets.sweep_targets({"sticky": None, "working_set": None}, 12, None)
    assert "none of the counts run (sticky none of the counts run) **missed**" in none


def test_a_sweep_whose_p95_its_cold_start_sets_says_so():
    """Every agent of a sweep starts at once: where its later turns need fewer replicas than
    all its turns, the missed target names the cold start and what each policy needs past it."""

    def run(p95, later_p95, n=1000, later_n=900):
        return {
            "turn_latency_s": {"p95": p95, "n": n},
            "later_turn_latency_s": {"p95": later_p95, "n": later_n},
            "turns_failed": 0,
            "hit_rate": 0.8,
            "turns_per_s": 32.0,
        }

    sweep = {
        8: {"sticky": run(2.9, 2.9), "working_set": run(2.8, 2.8)},
        12: {"sticky": run(2.04, 1.85), "working_set": run(2.02, 1.78)},
        16: {"sticky": run(1.81, 1.49), "working_set": run(1.81, 1.45)},
    }
    answer = report.sweep_answer(sweep, 2.0)
    later = report.sweep_answer(sweep, 2.0, "later_turn_latency_s")
    assert answer == {"sticky": 16, "working_set": 16} and later == {"sticky": 12, "working_set": 12}
    share = results_page.first_turn_share(sweep)
    assert share is not None and abs(share - 0.1) < 1e-9
    (line,) = results_cluster_targets.sweep_targets(answer, 12, None, later, share)
    assert line.endswith(
        "**missed**; limited by: the cold start: every agent's first turn starts at once, 10.0% of the turns, "
        "and without them working_set needs 12 replicas and sticky 12: past its cold start the gate needs no "
        "fewer replicas than sticky"
    )
    # the cold start does not decide where the later turns need as many replicas as all of them
    same = results_cluster_targets.sweep_targets(answer, 12, None, answer, share)
    assert same == [results_cluster_targets.sweep_targets(answer, 12, None)[0]] and "limited" not in same[0]
    # a record from before later turns were counted apart renders as before
    old = {
        n: {p: {k: v for k, v in s.items() if k != "later_turn_latency_s"} for p, s in r.items()}
        for n, r in sweep.items()
    }
    assert results_page.first_turn_share(old) is None
    assert report.sweep_answer(old, 2.0, "later_turn_latency_s") == {"sticky": None, "working_set": None}
    table = report.format_sweep(sweep, 2.0)
    assert "| 12 | 2.04 (1.85) / 0.800 / 32.0 |" in table
    assert "- working_set: turn p95 <= 2 s needs 16 replicas; of the later turns, 12 replicas" in table


def test_an_hour_of_the_fleet_is_judged_by_its_tail_its_turns_and_its_hit_rate():
    def fleet(p95, turns, of_ceiling, turns_per_s=110.0):
        return {
            "turn_latency_s": {"p95": p95},
            "turns_ok": turns,
            "turns_per_s": turns_per_s,
            "hit_rate_of_ceiling": of_ceiling,
        }

    lines = results_cluster_targets.fleet_targets(
        {"sticky": fleet(5.42, 398_844, 0.49), "working_set": fleet(5.41, 398_304, 0.49)}, 0.75
    )
    assert lines == [
        "- target: turn p95 <= sticky's: 5.410 s against 5.420 s **met**",
        "- target: turns served >= sticky's: 398,304 against 398,844 **missed**",
        "- target: hit rate >= 0.75 of the ceiling: 0.49 (sticky 0.49) **missed**",
    ]
    # turns served are counted: a lower rate over a makespan that drained one turn later is no loss
    sticky, gate = fleet(1.56, 412_289, 1.0, 114.4849), fleet(1.56, 412_290, 1.0, 114.4837)
    turns_line = results_cluster_targets.fleet_targets({"sticky": sticky, "working_set": gate}, 0.9)[1]
    assert turns_line == "- target: turns served >= sticky's: 412,290 against 412,289 **met**"
    assert results_cluster_targets.fleet_targets({"sticky": fleet(1, 1, 1)}, 0.9) == []  # no gate run: no target
    # short of sticky's, with the gate's waits known: what they add up to is named
    waited = gate | {
        "turns_ok": 412_281,
        "gate_wait_ms": {"n": 412_281, "mean": 0.2268, "p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 212.0},
    }
    turns_line = results_cluster_targets.fleet_targets({"sticky": sticky, "working_set": waited}, 0.9)[1]
    assert turns_line == (
        "- target: turns served >= sticky's: 412,281 against 412,289 **missed**; limited by: the gate's waits, "
        "94 s in all (mean 0.23 ms a turn, p99 0 ms, longest 212 ms), each one delaying its agent's later turns: "
        "8 fewer turns is 0.002% of sticky's"
    )


def test_a_missed_fleet_tail_the_gate_did_not_hold_says_so():
    """Turn p95 1.5595 s against sticky's 1.5590 s with the gate's own p95 wait 0: the tail
    is not its waits, and the line says so; where its waits reach the tail, nothing is named."""

    def fleet(p95, waits=None):
        return {
            "turn_latency_s": {"p95": p95},
            "turns_ok": 1,
            "turns_per_s": 1.0,
            "hit_rate_of_ceiling": 1.0,
            "gate_wait_ms": waits,
        }

    sticky = fleet(1.5590)
    calm = {"n": 10, "mean": 0.58, "p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 1000.0}
    (p95_line, *_) = results_cluster_targets.fleet_targets({"sticky": sticky, "working_set": fleet(1.5595, calm)}, 0.9)
    assert p95_line == (
        "- target: turn p95 <= sticky's: 1.560 s against 1.559 s **missed**; limited by: not the gate's waits "
        "(p95 0 ms, p99 0 ms, mean 0.6 ms): how the engines scheduled the turns it let in at once"
    )
    held = calm | {"p95": 1000.0}
    (p95_line, *_) = results_cluster_targets.fleet_targets({"sticky": sticky, "working_set": fleet(1.6, held)}, 0.9)
    assert p95_line.endswith("**missed**")


def test_a_missed_fleet_hit_rate_names_what_the_caches_could_hold():
    def fleet(of_ceiling, foresight, no_foresight):
        return {
            "turn_latency_s": {"p95": 1.0},
            "turns_ok": 1,
            "turns_per_s": 1.0,
            "hit_rate_of_ceiling": of_ceiling,
            "hit_rate_bound_of_ceiling": {"foresight": foresight, "no_foresight": no_foresight},
        }

    def hit_line(gate):
        return results_cluster_targets.fleet_targets({"sticky": fleet(0.49, 0.84, 0.58), "working_set": gate}, 0.75)[-1]

    only = hit_line(fleet(0.50, 0.84, 0.58))
    assert "0.50 (sticky 0.49) **missed**; limited by: only a policy that knows how long each tool call" in only
    assert "at most 0.84 of the ceiling keeping the windows of the shortest tool calls first, and 0.58 for a" in only
    assert "limited by: no policy meets it" in hit_line(fleet(0.50, 0.70, 0.58))
    assert "limited by: within reach of a policy" in hit_line(fleet(0.50, 0.90, 0.80))
    assert hit_line(fleet(0.80, 0.90, 0.80)).endswith("**met**")  # met: no limit to name


def test_record_and_page_carry_command_date_commit_and_every_target():
    document = {
        "modes": {"sticky": summary(), results_page.GATE_MODE: summary(makespan=12.0)},
        "replicas": {"count": 2, "shape": {}},
        "cost_preset": "h100-8b",
        "token_scale": 8,
    }
    record = record_of(
        ROWS[0], document, "kvgate bench agentic --regime no-pressure", "2026-12-01 21:00 UTC", "abc1234"
    )
    assert record["limit"] and not record["checks"][0]["met"]
    page = render([json.loads(json.dumps(record))])
    row = page.splitlines()[-1]
    for part in ("no-pressure", "kvgate bench agentic --regime no-pressure", "2026-12-01 21:00 UTC", "abc1234"):
        assert part in row
    assert "10.0 → 12.0 (1.20x)" in row and "**missed**" in row and "h100-8b (tokens / 8)" in row


def test_row_selection():
    assert all(not r.real_vllm for r in selected_rows(None, vllm=False))
    assert any(r.real_vllm for r in selected_rows(None, vllm=True))
    assert [r.regime for r in selected_rows("thrash,trace-8b", vllm=False)] == ["thrash", "trace-8b"]
    with pytest.raises(ValueError, match="nope"):
        selected_rows("nope", vllm=False)


def test_render_only_writes_the_page_from_the_data(tmp_path):
    document = {"modes": {"sticky": summary(), results_page.GATE_MODE: summary()}, "replicas": ["http://x"]}
    record = record_of(ROWS[-1], document, "python run", "d", "c")
    (tmp_path / "results.json").write_text(json.dumps([record]))
    args = argparse.Namespace(page=tmp_path / "results.md", data=None, render_only=True)
    assert results_page.main(args) == 0
    assert "real vLLM CPU" in (tmp_path / "results.md").read_text()


def test_store_row_replaces_its_key_and_keeps_the_others(tmp_path):
    document = {"modes": {"sticky": summary(), results_page.GATE_MODE: summary()}, "replicas": {"count": 2}}
    data, page = tmp_path / "results.json", tmp_path / "results.md"
    first = record_of(ROWS[0], document, "cmd a", "d1", "c1")
    other = record_of(ROWS[1], document, "cmd b", "d1", "c1")
    again = record_of(ROWS[0], document, "cmd a", "d2", "c2")
    for record in (first, other, again):
        results_page.store_row(data, page, record)
    stored = json.loads(data.read_text())
    assert [(r["key"], r["date"]) for r in stored] == [(ROWS[1].key, "d1"), (ROWS[0].key, "d2")]
    assert page.read_text().count("| cmd") == 0 and "`cmd a`" in page.read_text()


def test_each_real_vllm_model_has_a_pinned_row_with_its_target_and_an_unpinned_row_without():
    rows = selected_rows("vllm-small-no-finish,vllm-prefill-no-finish", vllm=True)
    assert [(r.regime, r.extra, r.targets) for r in rows] == [
        ("vllm-small-no-finish", ("--pinning", "pinned"), ("makespan<=1.05x",)),
        ("vllm-small-no-finish", ("--pinning", "unpinned"), ()),
        ("vllm-prefill-no-finish", ("--pinning", "pinned"), ("makespan<=0.8x",)),
        ("vllm-prefill-no-finish", ("--pinning", "unpinned"), ()),
        # and, where prefill is dear, whole sessions held (as prefill-bound's simulated rows)
        ("vllm-prefill-no-finish", ("--pinning", "pinned", "--work-conserving", "no"), ("makespan<=0.8x",)),
    ]
    assert len({r.key for r in rows}) == 5
    assert "--pinning pinned" in results_page.shown_command(rows[0], 3)
    assert results_page.row_command(rows[0], 3, results_page.REPO / "out")[-2:] == ["--pinning", "pinned"]


def test_a_row_of_short_rounds_runs_at_least_its_rounds_and_shows_them():
    """vllm-small's rounds last about 2 s: its rows run 9 rounds where `--repeat` asks fewer;
    a row without a minimum runs `--repeat`'s."""
    small, prefill = selected_rows("vllm-small --pinning pinned,vllm-prefill --pinning pinned", vllm=True)
    for repeat, rounds in ((3, "9"), (12, "12")):
        command = results_page.row_command(small, repeat, results_page.REPO / "out")
        assert command[command.index("--repeat") + 1] == rounds
        assert f"--repeat {rounds}" in results_page.shown_command(small, repeat)
    assert "--repeat 3" in results_page.shown_command(prefill, 3)


def test_a_real_vllm_row_names_its_cpu_split_and_an_untargeted_row_shows_no_target():
    pinned_row, unpinned_row = selected_rows("vllm-small-no-finish", vllm=True)
    document = {"modes": {"sticky": summary(), results_page.GATE_MODE: summary(makespan=10.3)}, "replicas": ["u"]}
    pinned = record_of(
        pinned_row, document, "c", "d", "e", {"pinning": "pinned", "engine_cpus": "1", "frontend_cpus": "0"}
    )
    unpinned = record_of(unpinned_row, document, "c", "d", "e", {"pinning": "unpinned", "engine_cpus": None})
    assert pinned["replicas"] == "real vLLM CPU, pinned: engine CPUs 1, frontend CPUs 0"
    assert unpinned["replicas"] == "real vLLM CPU, unpinned" and unpinned["checks"] == []
    page = render([pinned, unpinned]).splitlines()
    assert "makespan <= 1.05x sticky: 1.030x **met**" in page[-2]
    assert "| - | - |" in page[-1]


def test_the_page_judges_stored_rows_by_the_current_targets():
    document = {
        "modes": {"sticky": summary(), results_page.GATE_MODE: summary(makespan=10.21)},
        "replicas": {"count": 2},
    }
    record = record_of(ROWS[0], document, "cmd", "d", "c")
    record["checks"] = [{"target": "stale", "value": "1x", "met": True}]  # as an older generator wrote it
    row = render([record]).splitlines()[-1]
    assert "stale" not in row and "makespan <= 1.02x sticky: 1.021x **missed**" in row


def test_a_missed_makespan_target_names_a_faster_setting_measured_on_the_same_cache():
    """The rows of one regime with other gate settings (`--work-conserving no`) are the best
    policy measured on that cache; a run around the gate set up otherwise (`--pinning`) is not."""

    def stored(row, gate_makespan):
        document = {
            "modes": {"sticky": summary(makespan=100.0), results_page.GATE_MODE: summary(makespan=gate_makespan)},
            "replicas": {"count": 2},
        }
        return record_of(row, document, "cmd", "d", "c")

    dear, held_whole = (
        ResultRow("prefill-bound", ("makespan<=0.4x",)),
        ResultRow("prefill-bound", ("makespan<=0.4x",), ("--work-conserving", "no")),
    )
    default, whole = stored(dear, 60.0), stored(held_whole, 48.7)
    page = render([default, whole]).splitlines()
    assert "faster measured on this cache: `prefill-bound --work-conserving no`, 0.487x" in page[-2]
    assert "faster measured" not in page[-1]  # the faster row itself names nothing faster
    assert "faster measured" not in render([stored(dear, 40.0), stored(held_whole, 48.7)]).splitlines()[-2]
    # another setup around the gate is another cache: not compared
    assert (
        results_page.faster_on_this_cache(
            {**default, "key": "vllm-prefill-no-finish --pinning pinned"},
            [{**whole, "key": "vllm-prefill-no-finish --pinning unpinned"}],
        )
        == ""
    )


def test_only_takes_a_row_key_for_one_row_of_a_regime():
    pinned = selected_rows("vllm-small-no-finish --pinning pinned", vllm=False)
    assert [r.extra for r in pinned] == [("--pinning", "pinned")]
    assert len(selected_rows("vllm-small-no-finish", vllm=False)) == 2
    # a regime and one of its rows' keys: that row runs once
    both = selected_rows("prefill-bound,prefill-bound --work-conserving no", vllm=False)
    assert sorted(r.key for r in both) == ["prefill-bound", "prefill-bound --work-conserving no"]


def test_only_cluster_selects_the_fleet_runs_and_no_regime_row():
    assert selected_rows("cluster", vllm=False) == []
    assert [r.key for r in results_page.selected_cluster_rows("cluster")] == [
        "cluster-failure",
        "cluster-sweep",
        "cluster-fleet",
        "cluster-sweep-cpu-tier",
        "cluster-fleet-cpu-tier",
    ]
    assert [r.key for r in results_page.selected_cluster_rows("thrash,cluster-sweep")] == ["cluster-sweep"]
    assert results_page.selected_cluster_rows("thrash") == []
    assert len(results_page.selected_cluster_rows(None)) == len(results_page.CLUSTER_ROWS)
    # the page's rows are the ones docs/cluster.md shows, at its scale
    failure, sweep, fleet, tier_sweep, tier_fleet = results_page.CLUSTER_ROWS
    assert failure.options[:2] == ("--regime", "fleet-small") and "--fail-at-half" in failure.options
    assert sweep.sweep and not failure.sweep
    assert fleet.options == ("--regime", "fleet", "--fail-at-half") and not fleet.sweep  # the fleet at full scale
    # and the same two with a CPU tier of 4x the GPU KV (issue: the fleet without a tier and with one)
    assert tier_sweep.sweep and tier_sweep.options[-2:] == ("--cpu-tier", "4")
    assert tier_fleet.options[:3] == fleet.options and "--cpu-tier" in tier_fleet.options and not tier_fleet.sweep


@pytest.mark.bench_runs
def test_the_cluster_rows_run_their_command_and_keep_the_regime_rows(tmp_path, monkeypatch):
    """A run of each kind at a small scale (the real `kvgate sim cluster`; 2 s of the tiny
    regime are a thousand turns): the page shows the command, date and commit and the
    figures of the run, the plots' files land beside it, and the regime rows already stored
    stay."""
    small = (
        results_page.ClusterRow(
            "failure", "a failure", ("--regime", "tiny", "--agents", "4", "--duration", "2", "--fail-at-half",
                                     "--replicas", "2", "--policies", "sticky,working_set", "--no-plots"), ("table.md",)
        ),
        results_page.ClusterRow(
            "sweep", "a sweep", ("--regime", "tiny", "--policies", "sticky", "--replicas", "1,2", "--p95", "9"),
            ("sweep.md", "sweep.png"), max_replicas=1,
        ),
    )  # fmt: skip
    monkeypatch.setattr(results_page, "CLUSTER_ROWS", small)
    document = {"modes": {"sticky": summary(), results_page.GATE_MODE: summary()}, "replicas": {"count": 2}}
    data, page = tmp_path / "results.json", tmp_path / "results.md"
    results_page.store_row(data, page, record_of(ROWS[0], document, "cmd a", "d1", "c1"))
    for row in small:
        results_page.run_cluster_row(row, data, page, "abc1234")
    text = page.read_text()
    assert "`cmd a`" in text
    assert "`kvgate sim cluster --regime tiny --agents 4 --duration 2 --fail-at-half" in text
    assert "`kvgate sim cluster --regime tiny --policies sticky --replicas 1,2 --p95 9` (" in text
    assert text.count("abc1234)") == 2
    assert "| working_set |" in text and "| 2 |" in text and "turn p95 <= 9 s needs" in text
    # the sweep's target, judged (no working_set run here), and sticky's needs with every prefix kept
    assert "- target: working_set on at most 1 replicas and on fewer than sticky: none of the counts run" in text
    assert "sticky needs 1 (`kvgate sim cluster --regime tiny --replicas 1,2 --p95 9 --policies sticky" in text
    assert (tmp_path / "cluster" / "sweep" / "sweep.png").stat().st_size > 0
    assert (tmp_path / "cluster" / "failure" / "table.md").read_text().startswith("| policy |")
    stored = json.loads(data.read_text())
    assert [r["key"] for r in stored] == [ROWS[0].key, "cluster-failure", "cluster-sweep"]
    assert results_page.render(stored) == text  # the page is rendered from the stored data alone


def overhead_document(ratios: dict[int, float | None]) -> dict:
    """A `kvgate bench overhead --sessions` --out document with these on/off ratios."""
    rows = []
    for n, ratio in ratios.items():
        on = None if ratio is None else 100.0 * ratio
        rows.append(
            {
                "sessions": n,
                "clients": 16,
                "windows": n,
                "off": {"cpu_us_per_request": 100.0, "rps": 5000.0, "errors": 0, "runs": 3},
                "on": {"cpu_us_per_request": on, "rps": 4000.0, "errors": 1, "runs": 3},
                "cpu_ratio": ratio,
            }
        )
    return {"sessions": rows}


def test_the_overhead_row_is_judged_against_its_targets_and_names_its_limit_when_missed():
    met = results_overhead.record(overhead_document({100: 1.25, 1000: 1.4, 10000: 1.5}), "cmd o", "d", "c")
    text = render([met])
    assert "## The gate's CPU per request as its sessions grow" in text and "`cmd o` (d, c)" in text
    assert "| 100 | 100 | closed loop | 100 | 125 | 1.25x | <= 1.3x: 1.25x **met** | 1 |" in text
    assert "| 1000 | 1000 | closed loop | 100 | 140 | 1.40x | - | 1 |" in text  # no target at 1,000
    assert "<= 1.5x: 1.50x **met**" in text and "Limited by" not in text
    missed = results_overhead.record(overhead_document({100: 2.0, 10000: None}), "cmd o", "d", "c")
    text = render([missed])
    assert "<= 1.3x: 2.00x **missed**" in text and "<= 1.5x: no figure **missed**" in text
    assert f"Limited by {results_overhead.LIMIT}." in text
    # paced runs: a line of their own per size, judged too (a paced miss is a miss)
    document = overhead_document({100: 1.2})
    document["sessions"][0]["paced"] = {"rate": 2000.0, **overhead_document({100: 1.4})["sessions"][0]}
    text = render([results_overhead.record(document, "cmd o", "d", "c")])
    assert "| 100 | 100 | closed loop | 100 | 120 | 1.20x | <= 1.3x: 1.20x **met** | 1 |" in text
    assert "| 100 | 100 | 2000 req/s | 100 | 140 | 1.40x | <= 1.3x: 1.40x **missed** | 1 |" in text
    assert f"Limited by {results_overhead.LIMIT}." in text
    assert selected_rows("overhead", vllm=False) == []  # a row of its own, not a regime
    assert results_page.selected_cluster_rows("overhead") == []


def test_the_agent_body_row_is_a_section_of_its_own_after_the_short_message_one():
    agent = overhead_document({100: 1.1})
    agent["body_kib"] = 128
    stored = [
        results_overhead.record(agent, "cmd agent", "d", "c"),
        results_overhead.record(overhead_document({100: 1.2}), "cmd short", "d", "c"),
    ]
    assert [r["key"] for r in stored] == [results_overhead.AGENT_KEY, results_overhead.KEY]
    text = render(stored)
    short = text.index("## The gate's CPU per request as its sessions grow")
    long = text.index("## The same with an agent's 128 KiB history in every request (`--body-kib 128`)")
    assert short < text.index("`cmd short`") < long < text.index("`cmd agent`")
    assert "| 100 | 100 | closed loop | 100 | 110 | 1.10x | <= 1.3x: 1.10x **met** | 1 |" in text
    assert selected_rows("overhead-agent", vllm=False) == []  # a row of its own, not a regime


@pytest.mark.bench_runs
def test_the_overhead_row_runs_its_command_and_keeps_the_other_rows(tmp_path):
    """A real `kvgate bench overhead --sessions` at a small scale: its row lands on the page
    beside the rows already stored, rendered from the stored data alone."""
    document = {"modes": {"sticky": summary(), results_page.GATE_MODE: summary()}, "replicas": {"count": 2}}
    data, page = tmp_path / "results.json", tmp_path / "results.md"
    results_page.store_row(data, page, record_of(ROWS[0], document, "cmd a", "d1", "c1"))
    options = ("--sessions", "3", "--duration", "0.3", "--warmup", "0.1", "--repeats", "1", "--session-rate", "100")
    options += ("--body-kib", "8")  # every request an agent's 8 KiB history
    assert results_overhead.run_row(lambda record: results_page.store_row(data, page, record), "abc1234", options)
    text = page.read_text()
    assert (
        "`kvgate bench overhead --sessions 3 --duration 0.3 --warmup 0.1 --repeats 1 --session-rate 100 "
        "--body-kib 8` (" in text
    )
    assert "abc1234)" in text and "| 3 | 3 | closed loop |" in text and "| 3 | 3 | 100 req/s |" in text
    assert "## The same with an agent's 8 KiB history in every request" in text
    stored = json.loads(data.read_text())
    assert [r["key"] for r in stored] == [ROWS[0].key, results_overhead.AGENT_KEY]
    assert all(row["errors"] == 0 and row["on_us"] > 0 and row["off_us"] > 0 for row in stored[1]["sessions"])
    assert all(row["paced"]["rate"] == 100 and row["paced"]["errors"] == 0 for row in stored[1]["sessions"])
    assert results_page.render(stored) == text


def router_document(kvgate_rps: float, router_rps: float) -> dict:
    """A `kvgate bench overhead --router-command` --out document, one case, direct at 10,000 req/s."""

    def target(rps: float) -> dict:
        return {"rps": rps, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0}

    case = {
        "mode": "non-streaming",
        "concurrency": 64,
        "direct": target(10000.0),
        "proxied": target(kvgate_rps),
        "baseline": target(router_rps),
    }
    return {"target": "kvgate", "router_command": results_router.ROUTER, "results": [case]}


def test_the_router_row_is_judged_by_kvgates_share_of_direct_against_the_routers():
    missed = results_router.record(router_document(2800.0, 4900.0), "cmd r", "d", "c")
    text = render([missed])
    assert "## Throughput beside vllm-router" in text and "`cmd r` (d, c)" in text
    assert (
        "| non-streaming | 64 | 10000 | 2800 (0.28) | 4900 (0.49) | >= vllm-router's: 0.28 vs 0.49 **missed** | 0 |"
        in text
    )
    assert f"Limited by {results_router.LIMIT}." in text
    met = results_router.record(router_document(5000.0, 4900.0), "cmd r", "d", "c")
    text = render([met])
    assert ">= vllm-router's: 0.50 vs 0.49 **met**" in text and "Limited by" not in text
    assert selected_rows("router", vllm=False) == []  # a row of its own, not a regime


@pytest.mark.bench_runs
def test_the_router_row_runs_its_command_and_lands_on_the_page(tmp_path):
    """A real `kvgate bench overhead --router-command` at a small scale, with the benchmark's
    own upstream server standing in for the router (vllm-router is not installed here)."""
    data, page = tmp_path / "results.json", tmp_path / "results.md"
    stand_in = f"{sys.executable} -m kvgate.bench.overhead_upstream --port {{port}}"
    options = ("--concurrency", "2", "--modes", "non-streaming", "--duration", "0.3", "--warmup", "0.1")
    options += ("--repeats", "1", "--router-command", stand_in)
    store = lambda record: results_page.store_row(data, page, record)  # noqa: E731
    assert results_overhead.run_row(store, "abc1234", options, None, results_router.record, results_router.KEY)
    (stored,) = json.loads(data.read_text())
    assert stored["kind"] == "router" and stored["cases"][0]["errors"] == 0
    assert stored["cases"][0]["router_rps"] > 0 and stored["cases"][0]["kvgate_rps"] > 0
    assert "## Throughput beside vllm-router" in page.read_text()


def flood_document(pinned_hit: float, unpinned_hit: float, preemptions: int = 0) -> dict:
    """A tests/vllm_plugin/scripts/run_pin_flood.py --out document."""
    return {
        "server": "vLLM CPU, the tiny model (64 blocks of 32 tokens)",
        "num_total_blocks": 63,
        "block_size": 32,
        "window_blocks": 7,
        "flood_turns": 12,
        "flood_blocks": 15,
        "pinned_hit": pinned_hit,
        "unpinned_hit": unpinned_hit,
        "preemptions": preemptions,
    }


def test_the_pins_row_is_judged_by_both_windows_hits_and_the_preemptions():
    met = results_pins.record(flood_document(1.0, 0.0), "python run", "d", "c")
    text = render([met])
    assert "## A pinned window through a flood" in text and "`python run` (d, c)" in text
    assert "| 7 | 12 x 15 blocks | 1.00 | 0.00 | 0 | pinned hit 1.0, unpinned <= 0.1, no preemption: " in text
    assert "1.00 / 0.00 / 0 **met**" in text
    assert "**missed**" in render([results_pins.record(flood_document(0.86, 0.0), "r", "d", "c")])
    assert "**missed**" in render([results_pins.record(flood_document(1.0, 0.5), "r", "d", "c")])
    assert "**missed**" in render([results_pins.record(flood_document(1.0, 0.0, 1), "r", "d", "c")])
    assert selected_rows("pins", vllm=True) == []  # a row of its own, not a regime


def test_only_pins_without_vllm_is_refused(tmp_path, capsys):
    args = argparse.Namespace(
        page=tmp_path / "results.md", data=None, render_only=False, only="pins", repeat=1, vllm=False
    )
    assert results_page.main(args) == 2
    assert "--only pins runs on real vLLM: add --vllm" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_the_pins_row_runs_its_runner_and_lands_on_the_page(tmp_path):
    """The row's runner is called with --out and its document stored (a stand-in for the
    vLLM runner, which tests/vllm_plugin/test_pins_on_vllm.py runs on a real server)."""
    data, page = tmp_path / "results.json", tmp_path / "results.md"
    runner = tmp_path / "runner.py"
    document = json.dumps(flood_document(1.0, 0.0))
    runner.write_text(f"import sys, pathlib\npathlib.Path(sys.argv[2]).write_text({document!r})\n")
    store = lambda record: results_page.store_row(data, page, record)  # noqa: E731
    assert results_pins.run_row(store, "abc1234", tmp_path, runner.name)
    (stored,) = json.loads(data.read_text())
    assert stored["kind"] == "pins" and stored["commit"] == "abc1234" and stored["pinned_hit"] == 1.0
    assert "## A pinned window through a flood" in page.read_text()
    runner.write_text("import sys\nsys.exit(1)\n")
    assert not results_pins.run_row(store, "def5678", tmp_path, runner.name)
    assert json.loads(data.read_text())[0]["commit"] == "abc1234"


def test_every_regime_has_a_row_on_the_page_but_the_end_to_end_tests():
    # `tiny` runs on replicas that take no time (time_scale 0): nothing to measure
    assert {row.regime for row in ROWS} == set(REGIMES) - {"tiny"}
