"""`kvgate bench overhead`: the harness runs end to end and its arithmetic is right (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from kvgate.bench.overhead import compare, fmt, format_baseline_table, format_table, summarize
from kvgate.bench.overhead_load import chat_body
from kvgate.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]


def test_summary_takes_medians_and_compare_derives_added_p50_and_ratio():
    runs = [
        {"rps": r, "p50_ms": p, "p99_ms": p * 2, "errors": e, "error_kinds": {"status 502": e} if e else {}}
        for r, p, e in ((100, 1.0, 0), (300, 3.0, 1), (200, 2.0, 0))
    ]
    summary = summarize(runs)
    assert summary == {
        "rps": 200,
        "p50_ms": 2.0,
        "p99_ms": 4.0,
        "errors": 1,
        "error_kinds": {"status 502": 1},
        "runs": 3,
    }
    cmp = compare({"rps": 200, "p50_ms": 2.0}, {"rps": 100, "p50_ms": 2.5})
    assert cmp == {"added_p50_ms": 0.5, "throughput_ratio": 0.5}
    table = format_table(
        [{"mode": "streaming", "concurrency": 64, "direct": summary, "proxied": summary, **cmp}], "kvgate"
    )
    assert "streaming" in table and "0.50" in table
    assert "WARNING: streaming c=64 direct: 1 requests failed or answered non-200 (status 502: 1)" in table


def test_a_run_without_samples_prints_n_a():
    """A short run on a loaded machine may complete no request: the load generator writes
    its percentiles as null, and a router's CPU reading may be missing."""
    empty = {"requests": 0, "rps": 0.0, "p50_ms": None, "p99_ms": None, "errors": 0}
    full = {"requests": 9, "rps": 90.0, "p50_ms": 1.5, "p99_ms": 3.0, "errors": 0}
    direct, proxied = summarize([full]), summarize([empty])
    assert proxied["p50_ms"] is None and summarize([empty, full])["p50_ms"] == 1.5
    row = {"mode": "streaming", "concurrency": 4, "direct": direct, "proxied": proxied, **compare(direct, proxied)}
    assert row["added_p50_ms"] is None
    header, _, line = format_table([row], "kvgate").splitlines()
    assert line.count("n/a") == 3 and len(line) == len(header)  # p50, p99, added p50
    row |= {"baseline": direct | {"cpu_us_per_request": 20.0}, "baseline_vs_direct": compare(direct, direct)}
    header, _, line = format_baseline_table([row], "kvgate").splitlines()
    assert line.count("n/a") == 4 and len(line) == len(header)  # p50, added p50, cpu us/req, cpu vs baseline
    assert (fmt(None, ">9.3f"), fmt(float("nan"), ".3f"), fmt(1.25, ">9.3f")) == ("      n/a", "n/a", "    1.250")


@pytest.mark.bench_runs
def test_short_run_through_kvgate_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "overhead.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "bench",
            "overhead",
            "--duration",
            "1.0",  # a loaded CI machine still completes requests in each run
            "--warmup",
            "0.1",
            "--repeats",
            "1",
            "--concurrency",
            "4",  # one concurrency: each more adds two 1 s runs (direct and through kvgate) per mode
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "added p50 ms" in result.stdout
    data = json.loads(out.read_text())
    assert data["target"] == "kvgate"
    assert {(r["mode"], r["concurrency"]) for r in data["results"]} == {("non-streaming", 4), ("streaming", 4)}
    for r in data["results"]:
        assert r["direct"]["errors"] == 0 and r["proxied"]["errors"] == 0
        assert r["direct"]["rps"] > 0 and r["proxied"]["rps"] > 0


def test_a_body_of_k_kib_is_an_agents_history_of_tool_calls_and_results():
    short = orjson.loads(chat_body(stream=False))
    assert short["messages"] == [{"role": "user", "content": "hello"}] and short["stream"] is False
    body = chat_body(stream=True, body_kib=64)
    assert 64 * 1024 <= len(body) < 72 * 1024
    messages = orjson.loads(body)["messages"]
    assert [m["role"] for m in messages[1:5]] == ["assistant", "tool", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"]
    # another thread (a subagent): its own first message, the same history after it
    sub = orjson.loads(chat_body(stream=True, body_kib=64, thread=1))["messages"]
    assert sub[0] != messages[0] and sub[1:] == messages[1:]


def test_bad_arguments_exit_2():
    result = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "bench", "overhead", "--modes", "sideways"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2


def test_a_negative_body_size_is_refused_with_a_message(capsys):
    assert cli_main(["bench", "overhead", "--sessions", "3", "--body-kib", "-1"]) == 2  # before any process starts
    assert "--body-kib must be >= 0" in capsys.readouterr().err
    assert cli_main(["bench", "overhead", "--sessions", "3", "--body-threads", "0"]) == 2
    assert "--body-threads must be >= 1" in capsys.readouterr().err


@pytest.mark.bench_runs
def test_baseline_repo_is_measured_in_the_same_run_with_cpu_per_request(tmp_path):
    """The plumbing of --baseline-repo, with this checkout as its own baseline."""
    out = tmp_path / "overhead.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.cli",
            "bench",
            "overhead",
            "--duration",
            "0.3",
            "--warmup",
            "0.1",
            "--repeats",
            "1",
            "--concurrency",
            "2",
            "--modes",
            "non-streaming",
            "--gate-mode",
            "off",
            "--baseline-repo",
            str(REPO),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "rps vs baseline" in result.stdout and "cpu vs baseline" in result.stdout
    (row,) = json.loads(out.read_text())["results"]
    assert row["baseline"]["errors"] == 0 and row["baseline"]["rps"] > 0
    assert row["proxied"]["cpu_us_per_request"] > 0 and row["baseline"]["cpu_us_per_request"] > 0


@pytest.mark.bench_runs
def test_router_command_errors_say_what_to_fix():
    """Each a usage error (exit 2), said before any server starts."""

    def overhead(*options: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "kvgate.cli", "bench", "overhead", "--repeats", "1", *options]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)

    both = overhead("--router-command", "r --port {port}", "--baseline-repo", str(REPO))
    assert both.returncode == 2 and "not with --baseline-repo" in both.stderr
    missing = overhead(
        "--concurrency", "1", "--modes", "non-streaming", "--router-command", "kvgate-no-such-router {port}"
    )
    assert missing.returncode == 2 and "kvgate-no-such-router: no such program" in missing.stderr
    unknown = overhead("--concurrency", "1", "--modes", "non-streaming", "--router-command", "r --to {replicas}")
    assert unknown.returncode == 2 and "it may use {port} and ['upstream']" in unknown.stderr
    blank = overhead("--concurrency", "1", "--modes", "non-streaming", "--router-command", "  ")
    assert blank.returncode == 2 and "--router-command is empty" in blank.stderr
