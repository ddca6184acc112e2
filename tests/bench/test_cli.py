"""The agentic CLI: regime presets, overrides, and bad options (exit 2 naming the option)."""

import argparse

import pytest

from kvgate.bench.agentic.cli import build_plan, configure, main
from kvgate.bench.agentic.regimes import REGIMES


def parse(*argv):
    return configure(argparse.ArgumentParser()).parse_args(list(argv))


def test_regime_preset_with_overrides():
    plan, regime = build_plan(
        parse(
            "--regime",
            "thrash",
            "--sessions",
            "5",
            "--num-blocks",
            "99",
            "--idle-grace-sec",
            "7",
            "--modes",
            "sticky,kvgate-working_set",
            "--shared-system-prompt",
            "yes",
        )
    )
    assert regime == "thrash"
    assert plan.workload.spec.sessions == 5 and len(plan.workload.sessions) == 5
    assert plan.workload.spec.shared_system_prompt is True
    assert plan.workload.spec.tool_result_words_min == REGIMES["thrash"].workload.tool_result_words_min
    assert plan.shape.num_blocks == 99 and plan.shape.block_size == REGIMES["thrash"].shape.block_size
    assert plan.gate_settings["idle_grace_sec"] == 7.0
    assert plan.modes == ("sticky", "kvgate-working_set")


def test_a_real_vllm_regime_runs_its_server_or_the_simulated_replica_that_stands_for_it():
    regime = REGIMES["vllm-prefill-no-finish"]
    on_server, _ = build_plan(parse("--regime", regime.name, "--replica-url", "http://127.0.0.1:8000"))
    assert on_server.shape == regime.shape and on_server.block_size == 32  # the server's own tokens
    simulated, _ = build_plan(parse("--regime", regime.name))
    assert simulated.shape == regime.simulated_shape() and simulated.block_size == 9


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--modes", "sticky,fast"), "--modes"),
        (("--sessions", "0"), "sessions"),
        (("--repeat", "0"), "--repeat"),
        (("--replicas", "0"), "--replicas"),
        (("--regime", "thrash-capped", "--api", "responses"), "only --api chat"),
    ],
)
def test_bad_options_exit_2_naming_the_option(argv, message, capsys):
    assert main(parse(*argv)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "true", ""])
def test_a_yes_no_gate_option_refuses_anything_else_naming_the_option(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--work-conserving", value)
    assert exit_.value.code == 2
    assert "--work-conserving: expected yes or no" in capsys.readouterr().err
    assert parse("--work-conserving", "no").g_work_conserving is False


def test_sweep_refuses_given_servers(capsys):
    assert main(parse("--sweep", "--replica-url", "http://127.0.0.1:9")) == 2
    assert "--sweep" in capsys.readouterr().err


@pytest.mark.parametrize("value,expected", [(None, True), ("yes", True), ("no", False)])
def test_send_finish_option(value, expected):
    argv = ("--regime", "thrash") + (("--send-finish", value) if value else ())
    plan, _ = build_plan(parse(*argv))
    assert plan.workload.spec.send_finish is expected


def test_trace_regime_runs_the_trace_on_its_scaled_preset():
    plan, regime = build_plan(parse("--regime", "trace-8b", "--sessions", "6", "--agents", "3"))
    assert regime == "trace-8b" and len(plan.workload.sessions) == 6
    assert plan.workload.spec.concurrency == 3 and plan.workload.spec.shared_system_prompt
    assert plan.workload.spec.send_finish is False  # agents end sessions silently
    assert plan.cost_preset == "h100-8b" and plan.token_scale == 8
    assert plan.shape.num_blocks * plan.shape.block_size == pytest.approx(467_000 / 8, rel=0.01)
    assert plan.shape.step_overhead_s == pytest.approx(0.00575 * 8)
    lengths = {t.reply_tokens for s in plan.workload.sessions for t in s.turns}
    assert len(lengths) > 1  # every turn sets its own reply length


def test_token_scale_rescales_the_trace_and_the_replicas():
    coarse, _ = build_plan(parse("--regime", "trace-8b", "--sessions", "4", "--token-scale", "16"))
    fine, _ = build_plan(parse("--regime", "trace-8b", "--sessions", "4", "--token-scale", "4"))
    assert fine.shape.num_blocks == pytest.approx(4 * coarse.shape.num_blocks, rel=0.01)
    assert len(fine.workload.sessions[0].system_prompt.split()) == 4 * len(
        coarse.workload.sessions[0].system_prompt.split()
    )


def test_cost_preset_applies_to_any_regime_and_trace_options_need_a_trace(capsys):
    plan, _ = build_plan(parse("--regime", "thrash", "--cost-preset", "h100x2-70b"))
    assert plan.shape.prefill_token_s == pytest.approx(70e-6)
    assert main(parse("--regime", "thrash", "--token-scale", "4")) == 2
    assert "trace" in capsys.readouterr().err
    assert main(parse("--regime", "trace-8b", "--tool-result-words-min", "4")) == 2
    assert "trace" in capsys.readouterr().err
