"""What an unbounded KV cache reaches: the floor under a results row's makespan target.

A row that must run in a fraction of sticky's makespan (`makespan<=0.4x`) can miss it
because the gate wins back too little of the cache, or because no admission or retention
policy could reach it: tool calls, decode and the prefill of each turn's new tokens take
that long even with every prefix kept. The floor tells the two apart. It runs the row's
regime in the cluster simulation (`kvgate sim cluster`: virtual time, deterministic),
sticky on the regime's cache and sticky on a cache no workload fills (`UNBOUNDED_BLOCKS`
per replica: every prefix stays resident, the hit rate is the ceiling). The second
makespan over the first is the lowest ratio to sticky that any policy reaches on that
workload and fleet in the simulation.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from kvgate.bench.agentic.regimes import REGIMES

UNBOUNDED_BLOCKS = 1_000_000  # KV blocks per replica: more than any regime's sessions ever hold


def floor_options(regime: str, unbounded: bool) -> list[str]:
    """`kvgate sim cluster` options of one of the floor's two runs."""
    options = ["--regime", regime, "--policies", "sticky", "--no-plots"]
    return options + (["--num-blocks", str(UNBOUNDED_BLOCKS)] if unbounded else [])


def floor_of(bounded: dict, unbounded: dict, regime: str) -> dict:
    """The stored floor, from the two runs' sticky summaries (`report.json` -> policies.sticky).
    `of_server`: the regime runs on a real vLLM server, which its simulation stands for as
    measured (`Regime.cpu_engine`)."""
    return {
        "makespan_x": round(unbounded["makespan_s"] / bounded["makespan_s"], 3),
        "sticky_makespan_s": bounded["makespan_s"],
        "unbounded_makespan_s": unbounded["makespan_s"],
        "unbounded_hit_rate": unbounded["hit_rate"],
        "command": shlex.join(["kvgate", "sim", "cluster", *floor_options(regime, unbounded=True)]),
        "of_server": REGIMES[regime].cpu_engine is not None,
    }


def run_floor(regime: str, cwd: Path) -> dict | None:
    """Run both simulations of `regime` (seconds each) and return its floor; None (and a
    line on stderr) if either fails."""
    summaries = []
    with tempfile.TemporaryDirectory(prefix="kvgate-floor-") as scratch:
        for unbounded in (False, True):
            out = Path(scratch) / ("unbounded" if unbounded else "bounded")
            if not _simulate(floor_options(regime, unbounded), out, cwd, f"floor of {regime}"):
                return None
            summaries.append(json.loads((out / "report.json").read_text())["policies"]["sticky"])
    return floor_of(summaries[0], summaries[1], regime)


def _simulate(options: list[str], out: Path, cwd: Path, what: str) -> bool:
    """Run `kvgate sim cluster` with `options` into `out`; False (and a line on stderr
    naming `what`) if it fails."""
    command = [sys.executable, "-m", "kvgate.cli", "sim", "cluster", *options, "--out", str(out)]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"[results] {what}: exit {done.returncode}: {done.stderr[-500:]}", file=sys.stderr)
    return done.returncode == 0


def floor_note(floor: dict, limit: float) -> str:
    """The limit a missed `makespan <= limit x sticky` target meets, in the floor's terms."""
    simulation = "the cluster simulation"
    if floor.get("of_server"):
        simulation += " of this vLLM server (its measured steps and tokenizer, `Regime.cpu_engine`)"
    reach = (
        f"with every prefix kept (an unbounded cache) sticky itself takes {floor['makespan_x']:.2f}x "
        f"its makespan in {simulation} (`{floor['command']}`)"
    )
    if floor["makespan_x"] > limit:
        return f"no policy reaches {limit:g}x: {reach}"
    return f"within reach of a policy: {reach}"


def sweep_floor_options(options: tuple[str, ...]) -> list[str]:
    """A replica sweep's options for its floor: sticky alone, on a cache no workload fills (a
    CPU tier adds nothing there, and is left out)."""
    kept: list[str] = []
    rest = iter(options)
    for option in rest:
        if option in ("--policies", "--cpu-tier", "--num-blocks"):
            next(rest, None)  # its value goes too
        elif option != "--no-plots":
            kept.append(option)
    return [*kept, "--policies", "sticky", "--no-plots", "--num-blocks", str(UNBOUNDED_BLOCKS)]


def run_sweep_floor(options: tuple[str, ...], cwd: Path) -> dict | None:
    """Run a sweep's floor (`sweep_floor_options`): the fewest replicas sticky needs with every
    prefix kept, from its sweep.json; None (and a line on stderr) if the run fails."""
    from kvgate.bench.cluster.report import sweep_answer

    floor_options = sweep_floor_options(options)
    with tempfile.TemporaryDirectory(prefix="kvgate-floor-") as scratch:
        out = Path(scratch) / "run"
        if not _simulate(floor_options, out, cwd, "sweep floor"):
            return None
        document = json.loads((out / "sweep.json").read_text())
    sweep = {int(n): results for n, results in document["sweep"].items()}
    return {
        "replicas": sweep_answer(sweep, document["p95_target_s"]).get("sticky"),
        "command": shlex.join(["kvgate", "sim", "cluster", *floor_options]),
    }
