"""End-to-end smoke run of `kvgate bench agentic`: the tiny regime through real subprocesses.

Starts simulated replicas (`kvgate replica`) and a kvgate proxy as subprocesses of the
harness, which stops them itself; the test only reads what the run wrote.
"""

import json
import subprocess
import sys

import pytest

from bench.agentic.processes import replica_subcommand_exists


@pytest.fixture(scope="module")
def has_replica():
    if not replica_subcommand_exists():
        pytest.skip("`kvgate replica` (the simulator part) is not installed yet")


def test_tiny_regime_direct_and_kvgate(has_replica, tmp_path):
    out = tmp_path / "agentic"
    result = subprocess.run(
        [sys.executable, "-m", "bench.agentic", "--regime", "tiny", "--modes", "direct,kvgate",
         "--out", str(out), "--no-plots", "--request-timeout", "60"],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((out / "results.json").read_text())
    assert set(document["modes"]) == {"direct", "kvgate"}
    assert 0 < document["ceiling"]["hit_rate"] < 1
    for mode, summary in document["modes"].items():
        assert summary["turns_failed"] == 0 and summary["turns_not_run"] == 0, mode
        assert summary["turns_ok"] == summary["turns_planned"] > 0, mode
        assert summary["attempts_stranded"] == 0, mode
        assert summary["prompt_tokens_queried"] > 0 and 0 < summary["hit_rate"] <= 1, mode
        assert document["timelines"][mode], mode
    assert sum(document["modes"]["kvgate"]["admission_reasons"].values()) > 0  # headers came back
    assert document["modes"]["direct"]["admission_reasons"] == {}
    assert "kvgate" in result.stdout and "direct" in result.stdout  # the table was printed
    assert (out / "attempts_kvgate.jsonl").read_text().count("\n") == document["modes"]["kvgate"]["attempts"]


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_tiny_regime_speaks_each_client_api(has_replica, tmp_path, api):
    """The same conversation through /v1/messages and /v1/responses: every turn answered,
    the same prompt tokens as through chat (one rendering), sessions recognised by kvgate."""
    documents = {}
    for which in ("chat", api):
        out = tmp_path / which
        result = subprocess.run(
            [sys.executable, "-m", "bench.agentic", "--regime", "tiny", "--modes", "kvgate-contract",
             "--api", which, "--retry-prob", "0", "--out", str(out), "--no-plots", "--request-timeout", "60"],
            capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        documents[which] = json.loads((out / "results.json").read_text())
    summary, chat = documents[api]["modes"]["kvgate-contract"], documents["chat"]["modes"]["kvgate-contract"]
    assert documents[api]["api"] == api and summary["api"] == api
    assert summary["turns_ok"] == summary["turns_planned"] > 0 and summary["turns_failed"] == 0
    assert summary["prompt_tokens_queried"] == chat["prompt_tokens_queried"]
    assert "anonymous" not in summary["admission_reasons"]  # every turn was a named session
