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


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--modes", "sticky,fast"), "--modes"),
        (("--sessions", "0"), "sessions"),
        (("--repeat", "0"), "--repeat"),
        (("--replicas", "0"), "--replicas"),
    ],
)
def test_bad_options_exit_2_naming_the_option(argv, message, capsys):
    assert main(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_sweep_refuses_given_servers(capsys):
    assert main(parse("--sweep", "--replica-url", "http://127.0.0.1:9")) == 2
    assert "--sweep" in capsys.readouterr().err


@pytest.mark.parametrize("value,expected", [(None, True), ("yes", True), ("no", False)])
def test_send_finish_option(value, expected):
    argv = ("--regime", "thrash") + (("--send-finish", value) if value else ())
    plan, _ = build_plan(parse(*argv))
    assert plan.workload.spec.send_finish is expected
