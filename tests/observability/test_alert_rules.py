"""The alert rules: promtool checks them, runs their unit tests, and every alert has a
test where it fires and one where it must not; the compose Prometheus config is valid."""

from __future__ import annotations

import subprocess

import yaml

from tests.observability.helpers import ALERT_RULES, ALERT_TESTS, PROMETHEUS_DIR


def promtool(tools, *args: str, cwd=PROMETHEUS_DIR) -> str:
    done = subprocess.run([tools.promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def alert_names() -> list[str]:
    rules = yaml.safe_load(ALERT_RULES.read_text())
    return [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules(prometheus_tools):
    out = promtool(prometheus_tools, "check", "rules", str(ALERT_RULES))
    assert f"{len(alert_names())} rules found" in out


def test_promtool_unit_tests_pass(prometheus_tools):
    promtool(prometheus_tools, "test", "rules", str(ALERT_TESTS))


def test_every_alert_is_tested_firing_and_not_firing():
    fires, silent = set(), set()
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = set(alert_names())
    assert names - fires == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested staying silent"
    assert {
        "KvgateSessionsStarving",
        "KvgateProbeApiMissing",
        "KvgateLowHitRateUnderPressure",
        "KvgateReplicaUnhealthy",
        "KvgateGateConflict",
    } <= names  # the five


def test_every_alert_has_a_severity_and_a_runbook_link():
    for group in yaml.safe_load(ALERT_RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert f"docs/observability.md#{rule['alert'].lower()}" in rule["annotations"]["description"]


def test_compose_prometheus_config_is_valid(prometheus_tools, tmp_path):
    # the config names the rules where compose mounts them; point it at the repo's copy
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/kvgate-alerts.yml"]
    config["rule_files"] = [str(ALERT_RULES)]
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config))
    promtool(prometheus_tools, "check", "config", str(checked))
