"""Under a results row's makespan target: the least makespan any policy could take, and what
an unbounded KV cache reaches.

A row that must run in a fraction of sticky's makespan (`makespan<=0.4x`) can miss it
because the gate wins back too little of the cache, or because no admission or retention
policy could reach it. The floor tells the two apart. It runs the row's regime in the
cluster simulation (`kvgate sim cluster`: virtual time, deterministic), sticky on the
regime's cache, then sticky and the gate on a cache no workload fills (`UNBOUNDED_BLOCKS`
per replica: every prefix stays resident, the hit rate is the ceiling, and the gate holds
nothing: it only places new sessions evenly, `gate.place_sessions`).

- The bound (`bench/cluster/makespan_bound.py`, from sticky's run on the regime's cache):
  the least makespan any policy could serve those turns in on that cache, in seconds. Over
  the row's own sticky makespan (the same turns, measured), above the target, no policy
  meets it; at or below, the bound does not rule it out.
- The unbounded makespan over sticky's: what the simulation knows a policy to reach with
  every prefix kept, for scale.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from kvgate.bench.agentic.regimes import REGIMES
from kvgate.bench.cluster.makespan_bound import BOUND_PARTS, least_makespan

UNBOUNDED_BLOCKS = 1_000_000  # KV blocks per replica: more than any regime's sessions ever hold
UNBOUNDED_POLICIES = ("sticky", "working_set")  # on an unbounded cache: sticky, and the gate's placement


def floor_options(regime: str, unbounded: bool) -> list[str]:
    """`kvgate sim cluster` options of one of the floor's two runs."""
    policies = ",".join(UNBOUNDED_POLICIES) if unbounded else "sticky"
    options = ["--regime", regime, "--policies", policies, "--no-plots"]
    return options + (["--num-blocks", str(UNBOUNDED_BLOCKS)] if unbounded else [])


def floor_of(bounded: dict, unbounded: dict, regime: str, policy: str = "sticky") -> dict:
    """The stored floor, from sticky's summary on the regime's cache and `policy`'s on the
    unbounded one (`report.json` -> policies.<name>). `of_server`: the regime runs on a real
    vLLM server, which its simulation stands for as measured (`Regime.cpu_engine`)."""
    least = least_makespan(bounded)
    if least is None:
        raise ValueError(f"the floor of {regime}: sticky served no turn on its cache, so no makespan bound")
    bound_s, bound_by = least
    return {
        "makespan_x": round(unbounded["makespan_s"] / bounded["makespan_s"], 3),
        "sticky_makespan_s": bounded["makespan_s"],
        "unbounded_makespan_s": unbounded["makespan_s"],
        "unbounded_hit_rate": unbounded["hit_rate"],
        "unbounded_policy": policy,
        "command": shlex.join(["kvgate", "sim", "cluster", *floor_options(regime, unbounded=True)]),
        "of_server": REGIMES[regime].cpu_engine is not None,
        "bound_s": bound_s,
        "bound_by": bound_by,
        "bound_command": shlex.join(["kvgate", "sim", "cluster", *floor_options(regime, unbounded=False)]),
    }


def run_floor(regime: str, cwd: Path) -> dict | None:
    """Run both simulations of `regime` (seconds each) and return its floor; None (and a
    line on stderr) if either fails."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvgate-floor-") as scratch:
        for unbounded in (False, True):
            out = Path(scratch) / ("unbounded" if unbounded else "bounded")
            if not _simulate(floor_options(regime, unbounded), out, cwd, f"floor of {regime}"):
                return None
            runs.append(json.loads((out / "report.json").read_text())["policies"])
    fastest = min(UNBOUNDED_POLICIES, key=lambda policy: runs[1][policy]["makespan_s"])
    return floor_of(runs[0]["sticky"], runs[1][fastest], regime, fastest)


def _simulate(options: list[str], out: Path, cwd: Path, what: str) -> bool:
    """Run `kvgate sim cluster` with `options` into `out`; False (and a line on stderr
    naming `what`) if it fails."""
    command = [sys.executable, "-m", "kvgate.cli", "sim", "cluster", *options, "--out", str(out)]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"[results] {what}: exit {done.returncode}: {done.stderr[-500:]}", file=sys.stderr)
    return done.returncode == 0


def floor_note(floor: dict, limit: float, sticky_makespan_s: float) -> str:
    """The limit a missed `makespan <= limit x sticky` target meets, in the floor's terms: the
    least makespan any policy could take on the row's cache, over the row's own sticky
    makespan `sticky_makespan_s`, decides; the unbounded cache's makespan follows, for scale."""
    simulation = "the cluster simulation"
    if floor.get("of_server"):
        simulation += " of this vLLM server (its measured steps and tokenizer, `Regime.cpu_engine`)"
    if floor.get("unbounded_policy", "sticky") == "sticky":
        takes = f"sticky itself takes {floor['makespan_x']:.2f}x its makespan"
    else:
        takes = f"the gate, placing sessions, takes {floor['makespan_x']:.2f}x sticky's makespan"
    reach = f"with every prefix kept (an unbounded cache) {takes} in {simulation} (`{floor['command']}`)"
    bound_x = floor["bound_s"] / sticky_makespan_s
    bound = (
        f"the least makespan any policy could take on this cache is {floor['bound_s']:.1f} s in {simulation}, "
        f"{bound_x:.2f}x this row's sticky ({BOUND_PARTS[floor['bound_by']]}: "
        f"`bench/cluster/makespan_bound.py` on `{floor['bound_command']}`)"
    )
    if bound_x > limit:
        return f"no policy reaches {limit:g}x: {bound}; {reach}"
    return f"not ruled out: {bound}; {reach}"


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
