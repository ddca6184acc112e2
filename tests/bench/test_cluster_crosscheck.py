"""The virtual-time cluster against the wall-clock benchmark on the same workload and replicas.

`kvgate bench agentic` runs real processes (two simulated replicas, the kvgate proxy,
the HTTP client) in real time; `kvgate sim cluster` runs the same gate, balancer and
engine model in one process in virtual time, on the proxy's own turn path: in both, the
gate learns each served turn's size and hit from its usage (`Lease.learn`). On the same sessions and replica shape
they must agree within:

- hit rate: 0.05 absolute. Both engines are the same code fed the same token
  sequences; what differs is only which turns meet in the cache, and that moves with
  the wall-clock run's timing jitter (a turn that arrives a few ms later finds its
  blocks evicted or not).
- makespan and mean turn latency: 40%; turn latency p95: 30% or 0.15 s, whichever
  is larger; the p50 likewise for sticky only. The wall-clock run adds what virtual
  time leaves out (HTTP relaying through the proxy, the client, probe round trips
  that render the whole chat: milliseconds a turn) and runs late on a loaded machine
  (a simulated replica's asyncio sleep overshoots; CI shares two cores with other
  work), and a closed loop carries each delay into the next turn's start. The gated
  policy suffers most: each held turn's re-decisions wait on prefix probes that a
  starved replica process answers late (on a quiet machine all agree within a few
  percent).
- A gated policy's turn latencies are bimodal (admitted at once, or held for at least
  one `wait_poll_sec`), so their median falls on either side with a small shift in
  timing: it is printed, not bounded.

Those tolerances hold on a machine with a few other busy processes. Other work on the
machine makes each of the wall-clock run's timer wake-ups (an engine step's sleep, each
HTTP hop) late by the time its process waits for a CPU, which virtual time cannot know.
So the test measures that lateness while the benchmark runs (`Lateness`: a process that
sleeps 5 ms at a time and records how late it wakes) and lets the wall-clock figures run
later than virtual time by that much more: per turn, lateness x `WAKES_PER_TURN`; for the
makespan, x that many per turn of the longest session. Only in that direction: a loaded
machine never makes the wall-clock run faster. On a quiet machine the lateness is a
fraction of a millisecond and the bounds are the ones above.

The two modes' wall-clock runs run at once, in the background (tests/bench/crosscheck_runs.py):
each mostly sleeps, so tests/conftest.py starts them with the first test of this file's
xdist group and fills the group with other tests, which run meanwhile; these tests come
last and wait for what is left.
"""

from __future__ import annotations

import pytest

from kvgate.bench.agentic.regimes import get_regime
from kvgate.bench.agentic.workload import generate_workload
from kvgate.bench.cluster.report import summarize
from kvgate.bench.cluster.run import ClusterConfig, run_policy
from kvgate.bench.cluster.workload import sessions_of
from kvgate.simulator.config import EngineConfig
from tests.bench.crosscheck_runs import CHANGES, MODES, RUNS, TIME_SCALE, Lateness

# The xdist group tests/conftest.py starts the wall-clock runs for, and fills with other tests.
pytestmark = pytest.mark.xdist_group("cluster_crosscheck")

# A turn's timer wake-ups in the wall-clock run: an engine step's sleep for each of its
# 8 reply tokens and its prefill (2 chunks at most), and about 6 hops (client, proxy,
# replica and back; a gate probe), so 16.
WAKES_PER_TURN = 16


@pytest.fixture(scope="module")
def wall_clock_runs():
    """Both modes' wall-clock runs (started at the beginning of this xdist group) and the
    machine's wake-up lateness while they ran."""
    try:
        yield RUNS.results()
    finally:
        RUNS.stop()


def _cluster(policy: str) -> dict:
    regime = get_regime("thrash")
    spec = regime.workload.replace(**CHANGES)
    shape = regime.shape
    config = ClusterConfig(
        replicas=regime.replicas,
        engine=EngineConfig(
            shape.num_blocks, shape.block_size, shape.max_num_seqs, shape.max_num_batched_tokens, shape.max_model_len
        ),
        time_scale=TIME_SCALE,
        gate=regime.gate,
        sessions=tuple(sessions_of(generate_workload(spec, 0))),
        concurrency=spec.concurrency,
    )
    return summarize(run_policy(config, policy))


def _close(simulated: float, measured: float, relative: float, absolute: float = 0.0, late: float = 0.0) -> bool:
    """Within the tolerance either way; the wall-clock figure may also be up to `late` seconds later."""
    allowed = max(relative * measured, absolute)
    return -allowed <= measured - simulated <= allowed + late


@pytest.mark.parametrize("mode", MODES)
def test_virtual_time_agrees_with_the_wall_clock_benchmark(wall_clock_runs: tuple[dict, Lateness], mode):
    runs, lateness = wall_clock_runs
    m = runs[mode]
    policy = MODES[mode]
    s = _cluster(policy)
    turn_late = lateness.mean_sec * WAKES_PER_TURN
    late = {"makespan_s": turn_late * CHANGES["turns_max"], "turn_mean_s": turn_late, "turn_p95_s": turn_late}
    print(f"\nwake-up lateness during the wall-clock run: {lateness.mean_sec * 1000:.2f} ms mean "
          f"({lateness.samples} samples); a turn may run {turn_late:.3f} s later")  # fmt: skip
    report = []
    assert m["turns_failed"] == 0 and s["turns_failed"] == 0
    assert s["turns_ok"] == m["turns_ok"]
    pairs = {
        "hit_rate": (s["hit_rate"], m["hit_rate"], 0.0, 0.05),
        "makespan_s": (s["makespan_s"], m["makespan_s"], 0.40, 0.0),
        "turn_mean_s": (s["turn_latency_s"]["mean"], m["turn_latency_s"]["mean"], 0.40, 0.15),
        "turn_p95_s": (s["turn_latency_s"]["p95"], m["turn_latency_s"]["p95"], 0.30, 0.15),
        "turn_p50_s": (s["turn_latency_s"]["p50"], m["turn_latency_s"]["p50"], 0.30, 0.15),
    }
    for name, (sim, wall, relative, absolute) in pairs.items():
        if name == "turn_p50_s" and policy != "sticky":
            verdict = "not bounded"
        else:
            verdict = "ok" if _close(sim, wall, relative, absolute, late.get(name, 0.0)) else "OUT"
        report.append((mode, name, round(sim, 3), round(wall, 3), verdict))
    print("\n".join(f"{mode:<20}{name:<12} virtual {sim:>8} wall-clock {wall:>8} {verdict}"
                    for mode, name, sim, wall, verdict in report))  # fmt: skip
    assert all(verdict != "OUT" for *_, verdict in report), report
