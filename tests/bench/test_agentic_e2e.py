"""End-to-end smoke run of `kvgate bench agentic`: the tiny regime through real subprocesses.

Starts simulated replicas (`kvgate replica`) and a kvgate proxy as subprocesses of the
harness, which stops them itself; the test only reads what the run wrote.
"""

import pytest
from run_agentic import run_tiny_regime


def test_tiny_regime_direct_and_kvgate(tmp_path):
    out = tmp_path / "agentic"
    document, printed = run_tiny_regime(out, "direct,kvgate-watermark")
    assert set(document["modes"]) == {"direct", "kvgate-watermark"}
    assert 0 < document["ceiling"]["hit_rate"] < 1
    for mode, summary in document["modes"].items():
        assert summary["turns_failed"] == 0 and summary["turns_not_run"] == 0, mode
        assert summary["turns_ok"] == summary["turns_planned"] > 0, mode
        assert summary["attempts_stranded"] == 0, mode
        assert summary["prompt_tokens_queried"] > 0 and 0 < summary["hit_rate"] <= 1, mode
        assert document["timelines"][mode], mode
    assert sum(document["modes"]["kvgate-watermark"]["admission_reasons"].values()) > 0  # headers came back
    assert document["modes"]["direct"]["admission_reasons"] == {}
    assert "kvgate-watermark" in printed and "direct" in printed  # the table was printed
    assert (out / "attempts_kvgate-watermark.jsonl").read_text().count("\n") == document["modes"]["kvgate-watermark"][
        "attempts"
    ]


API_RUN = ("kvgate-working_set", "--retry-prob", "0")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> dict:
    """The conversation through chat, run once for every API it is compared with."""
    return run_tiny_regime(tmp_path_factory.mktemp("chat"), *API_RUN, "--api", "chat")[0]


@pytest.mark.xdist_group("agentic_chat_run")  # one worker runs both APIs' tests, and chat once
@pytest.mark.parametrize("api", ["messages", "responses"])
def test_tiny_regime_speaks_each_client_api(tmp_path, api, chat_run):
    """The same conversation through /v1/messages and /v1/responses: every turn answered,
    the same prompt tokens as through chat (one rendering), sessions recognised by kvgate."""
    document, _ = run_tiny_regime(tmp_path / api, *API_RUN, "--api", api)
    summary, chat = document["modes"]["kvgate-working_set"], chat_run["modes"]["kvgate-working_set"]
    assert document["api"] == api and summary["api"] == api
    assert summary["turns_ok"] == summary["turns_planned"] > 0 and summary["turns_failed"] == 0
    assert summary["prompt_tokens_queried"] == chat["prompt_tokens_queried"]
    assert "anonymous" not in summary["admission_reasons"]  # every turn was a named session
