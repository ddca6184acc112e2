"""bench.gate_load stays runnable: a tiny run ends with no failed turn and nothing leaked."""

from __future__ import annotations

import json

import pytest

from kvgate.bench import gate_load


def test_gate_load_small_run_watermark_policy(tmp_path, capsys):
    out = tmp_path / "gate_load.json"
    code = gate_load.main(
        [
            "--sessions",
            "4",
            "--turns",
            "2",
            "--ramp-sec",
            "0.05",
            "--in-process-replicas",
            "--modes",
            "enforce,shadow",
            "--policy",
            "watermark",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    assert runs[0]["reasons"] == {"open": 8}
    assert runs[1]["reasons"] == {"shadow_open": 8}


def test_gate_load_small_run(tmp_path, capsys):
    out = tmp_path / "gate_load.json"
    code = gate_load.main(
        [
            "--sessions",
            "6",
            "--turns",
            "3",
            "--ramp-sec",
            "0.05",
            "--in-process-replicas",
            "--modes",
            "off,enforce,shadow",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert [run["mode"] for run in result["runs"]] == ["off", "enforce", "shadow"]
    for run in result["runs"]:
        assert (run["turns"], run["failed"], run["leaked"]) == (18, 0, {})
    assert result["runs"][0]["reasons"] == {"open": 18}
    # No pressure under the default working_set policy: each session's first turn fits,
    # the rest come back to their window; shadow records the same decisions.
    assert result["runs"][1]["reasons"] == {"window_fits": 6, "holds_window": 12}
    assert result["runs"][2]["reasons"] == {"shadow_window_fits": 6, "shadow_holds_window": 12}
    assert "added gate p50" in printed


def test_gate_load_rejects_bad_modes(capsys):
    with pytest.raises(SystemExit) as exit_:
        gate_load.main(["--modes", "hold"])
    assert exit_.value.code == 2
    assert "--modes takes off, enforce and shadow" in capsys.readouterr().err
