"""`kvgate bench agentic` scale-out modes end to end (tiny regime, real subprocesses):
two front doors over replica gates, and two standalone gates on the same replicas with
conflict detection on."""

import json
import subprocess
import sys

import pytest
from run_agentic import run_tiny_regime

pytestmark = pytest.mark.bench_runs


def test_tiny_regime_tiers_and_naive_detected(tmp_path):
    out = tmp_path / "agentic"
    modes = run_tiny_regime(out, "tiers,naive-detected")[0]["modes"]
    for mode, summary in modes.items():
        assert summary["turns_failed"] == 0 and summary["turns_not_run"] == 0, mode
        assert summary["turns_ok"] == summary["turns_planned"] > 0, mode
    tiers = modes["tiers"]
    # the replica gates' reasons reached the clients through the front doors, and nothing conflicted
    assert tiers["gate_conflicts"] == [0.0] * 4  # 2 front doors, 2 replica gates
    # ("open" can still appear: a usage probe that times out on a loaded machine admits open)
    assert "window_fits" in tiers["admission_reasons"]
    assert not any(r.startswith("shadow_") for r in tiers["admission_reasons"])
    detected = modes["naive-detected"]
    # the late kvgate found both replicas owned by the first: it shadows them and says so (its /ready
    # is 503, so the clients, routed by readiness, only use the first: nothing was shadowed)
    assert detected["gate_conflicts"][1] == 2.0
    assert not any(r.startswith("shadow_") for r in detected["admission_reasons"])
    log = (out / "logs" / "naive-detected" / "kvgate1.log").read_text()
    assert log.count("gate conflict on replica") == 2


def test_scale_out_load_small(tmp_path):
    """bench/scale_out_load.py at CI size: no failed turn, no leak, no conflict, no session moved."""
    out = tmp_path / "load.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.bench.scale_out_load",
            "--sessions",
            "150",
            "--turns",
            "3",
            "--replicas",
            "2",
            "--front-doors",
            "2",
            "--layouts",
            "single,tiers",
            "--ramp-sec",
            "0.5",
            "--log-dir",
            str(tmp_path / "logs"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,  # a hang, not a slow machine: the runs take 1-4 minutes under load
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["layout"] for r in runs] == ["single", "tiers"]
    for run in runs:
        assert run["turns"] == 450 and run["failed"] == 0 and run["leaked"] == {} and run["conflicts"] == 0
        assert run["moved_sessions"] == 0
        assert set(run["reasons"]) <= {"window_fits", "holds_window"}  # the gate's own, through the doors


def test_scale_out_load_front_door_killed(tmp_path):
    """Front door 0 is SIGKILLed mid-run: its clients fail over, re-sending only the turns that were
    in flight there, every turn completes, and every session stays on its replica."""
    out = tmp_path / "load.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.bench.scale_out_load",
            "--sessions",
            "200",
            "--turns",
            "8",
            "--replicas",
            "2",
            "--front-doors",
            "2",
            "--layouts",
            "tiers",
            "--ramp-sec",
            "1",
            "--kill-front-door-after",
            "0.5",
            "--log-dir",
            str(tmp_path / "logs"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,  # a hang, not a slow machine: the runs take 1-4 minutes under load
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["killed_door_outstanding"] is not None
    assert run["resent_turns"] <= run["killed_door_outstanding"]
    assert run["turns"] == 1600 and run["failed"] == 0 and run["moved_sessions"] == 0
    assert run["leaked"] == {} and run["conflicts"] == 0
