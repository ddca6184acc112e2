"""The fleet rows' targets on the results page (issue targets of the cluster simulation's
runs), judged from the stored summaries: pure functions, one line of text per row.

- A replica sweep: the gate (working_set) keeps the turn p95 within the sweep's target on
  at most a given number of replicas, and on fewer than sticky needs.
- An hour of the fleet: the gate's turn p95 at most sticky's, its turns served in the
  hour at least sticky's (counted: a rate would divide by the makespan, which ends with
  the last turn in flight at the hour, a policy's own drain), and its hit rate at least
  a share of the ceiling (missed: with the share its caches could hold at all,
  `bench.cluster.cache_bound`).
"""

from __future__ import annotations


def sweep_targets(
    answer: dict[str, int | None],
    max_replicas: int,
    floor: dict | None,
    later: dict[str, int | None] | None = None,
    first_turn_share: float | None = None,
) -> list[str]:
    """The sweep's target, judged: the gate (working_set) keeps the turn p95 within its target
    on at most `max_replicas` replicas and on fewer than sticky needs. Missed, with what
    sticky needs with every prefix kept (`floor`) when that alone rules the target out, and
    with the cold start (`cold_start`) where the turns after each session's first (`later`:
    what each policy needs for those) are within the target on fewer replicas."""

    def needs(policy: str) -> str:
        n = answer.get(policy)
        return "none of the counts run" if n is None else f"{n}"

    gate, sticky = answer.get("working_set"), answer.get("sticky")
    met = gate is not None and gate <= max_replicas and (sticky is None or gate < sticky)
    line = (
        f"- target: working_set on at most {max_replicas} replicas and on fewer than sticky: "
        f"{needs('working_set')} (sticky {needs('sticky')}) **{'met' if met else 'missed'}**"
    )
    limits = []
    if not met and floor is not None and floor["replicas"] is not None:
        verdict = "no policy meets it" if floor["replicas"] > max_replicas else "within reach of a policy"
        limits.append(
            f"{verdict}: with every prefix kept (an unbounded cache) sticky needs "
            f"{floor['replicas']} (`{floor['command']}`)"
        )
    if not met and later is not None and first_turn_share is not None:
        limits += cold_start(answer, later, first_turn_share)
    if limits:
        line += "; limited by: " + "; and ".join(limits)
    return [line]


def cold_start(answer: dict[str, int | None], later: dict[str, int | None], first_turn_share: float) -> list[str]:
    """Where the gate's p95 of every turn needs more replicas than that of its later turns (each
    session's first left out), the run's cold start sets it: its agents all start at once, and
    their first turns (`first_turn_share` of the run's) queue behind one another under every
    policy. Says what each policy needs past it. Nothing where the two agree."""
    gate, gate_later = answer.get("working_set"), later.get("working_set")
    if gate_later is None or (gate is not None and gate <= gate_later):
        return []
    sticky_later = later.get("sticky")
    same = sticky_later is not None and gate_later >= sticky_later
    return [
        f"the cold start: every agent's first turn starts at once, {first_turn_share:.1%} of the turns, "
        f"and without them working_set needs {gate_later} replicas and sticky "
        f"{'more than swept' if sticky_later is None else sticky_later}"
        + (": past its cold start the gate needs no fewer replicas than sticky" if same else "")
    ]


def fleet_targets(policies: dict[str, dict], hit_of_ceiling: float) -> list[str]:
    """An hour of the fleet judged (`policies`: the stored summaries by policy): working_set's
    turn p95 <= sticky's, turns served >= sticky's (`turns_ok`), hit rate >= `hit_of_ceiling` of the ceiling;
    a missed hit rate with how much of the ceiling the caches could hold at all, a missed
    p95 that the gate's waits do not explain (its own p95 wait is 0) with those waits, and
    turns served short of sticky's with what the gate's waits add up to."""
    gate, sticky = policies.get("working_set"), policies.get("sticky")
    if gate is None or sticky is None:
        return []
    gate_p95, sticky_p95 = gate["turn_latency_s"]["p95"], sticky["turn_latency_s"]["p95"]
    of_ceiling, sticky_of_ceiling = gate["hit_rate_of_ceiling"], sticky["hit_rate_of_ceiling"]
    hit_met = of_ceiling >= hit_of_ceiling
    hit_line = f"hit rate >= {hit_of_ceiling:g} of the ceiling: {of_ceiling:.2f} (sticky {sticky_of_ceiling:.2f})"
    checks = [
        (f"turn p95 <= sticky's: {gate_p95:.3f} s against {sticky_p95:.3f} s", gate_p95 <= sticky_p95),
        (
            f"turns served >= sticky's: {gate['turns_ok']:,} against {sticky['turns_ok']:,}",
            gate["turns_ok"] >= sticky["turns_ok"],
        ),
        (hit_line, hit_met),
    ]
    lines = [f"- target: {text} **{'met' if met else 'missed'}**" for text, met in checks]
    waits = gate.get("gate_wait_ms")
    if gate_p95 > sticky_p95 and waits and waits["p95"] == 0:
        lines[0] += "; limited by: " + not_the_waits(waits)
    if gate["turns_ok"] < sticky["turns_ok"] and waits:
        lines[1] += "; limited by: " + waits_delay_turns(
            waits, sticky["turns_ok"] - gate["turns_ok"], sticky["turns_ok"]
        )
    bound = gate.get("hit_rate_bound_of_ceiling")
    if not hit_met and bound:
        lines[-1] += "; limited by: " + cache_limit(bound, hit_of_ceiling)
    return lines


def not_the_waits(waits: dict) -> str:
    """A tail the gate's waits do not explain: fewer than one turn in twenty waited at all."""
    return (
        f"not the gate's waits (p95 0 ms, p99 {waits['p99']:.0f} ms, mean {waits['mean']:.1f} ms): "
        "how the engines scheduled the turns it let in at once"
    )


def waits_delay_turns(waits: dict, fewer: int, sticky_turns: int) -> str:
    """Turns served short of sticky's: each wait at the gate delays its agent's later turns
    (a closed loop), so what the gate's waits add up to is what the hour lost."""
    total_sec = waits["mean"] * waits["n"] / 1000.0
    return (
        f"the gate's waits, {total_sec:.0f} s in all (mean {waits['mean']:.2f} ms a turn, p99 {waits['p99']:.0f} ms, "
        f"longest {waits['max']:.0f} ms), each one delaying its agent's later turns: {fewer:,} fewer turns is "
        f"{fewer / sticky_turns:.3%} of sticky's"
    )


def cache_limit(bound: dict, target: float) -> str:
    """What the caches' block-seconds allow (`bench.cluster.cache_bound`) against a hit-rate target."""
    foresight, no_foresight = bound["foresight"], bound["no_foresight"]
    if foresight < target:
        verdict = "no policy meets it"
    elif no_foresight < target:
        verdict = "only a policy that knows how long each tool call takes could meet it"
    else:
        verdict = "within reach of a policy"
    return (
        f"{verdict}: the caches' block-seconds hold at most {foresight:.2f} of the ceiling keeping the "
        f"windows of the shortest tool calls first, and {no_foresight:.2f} for a policy that cannot tell how "
        "long a tool call will take, whatever mix of keep-times it gives the windows "
        "(the relaxation in `bench/cluster/cache_bound.py`)"
    )
