"""Configuration: YAML + KVGATE_* overrides + validation, and `kvgate check-config`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.balancer.balancer import ALGORITHMS
from kvgate.balancer.settings import ReplicaSettings
from kvgate.gate.gate import MODES
from kvgate.gate.policies.registry import POLICIES
from kvgate.proxy.config import ConfigError, load_settings, settings_from_dict
from kvgate.proxy.settings import Settings
from kvgate.proxy.topology import ROLES

REPO = Path(__file__).resolve().parents[2]


def problems_of(data=None, environ=None, tmp_path=None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        if environ is None:
            settings_from_dict(data)
        else:
            load_settings(None, environ)
    return info.value.problems


def test_empty_config_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_settings(path, {}) == Settings()


def test_annotated_default_file_equals_the_built_in_defaults():
    assert load_settings(REPO / "configs" / "kvgate.yaml", {}) == Settings()


def load_example_configs(folder: Path) -> list[str]:
    """Load every `*.yaml` in `folder` (ConfigError on the first invalid one); the names loaded.
    A folder with none fails: a glob over nothing would pass for any content."""
    paths = sorted(folder.glob("*.yaml"))
    assert paths, f"no example config (*.yaml) in {folder}"
    for path in paths:
        load_settings(path, {})
    return [path.name for path in paths]


def test_every_example_config_is_valid():
    assert "kvgate.yaml" in load_example_configs(REPO / "configs")


def test_the_example_config_check_fails_on_an_empty_folder_and_on_an_invalid_file(tmp_path):
    with pytest.raises(AssertionError, match="no example config"):
        load_example_configs(tmp_path)
    (tmp_path / "good.yaml").write_text("gate: {mode: shadow}\n")
    (tmp_path / "bad.yaml").write_text("gate: {mode: sideways}\n")
    with pytest.raises(ConfigError, match="gate.mode"):
        load_example_configs(tmp_path)


def test_values_are_read(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "replicas: [{name: a, url: 'http://h:1', weight: 2}]\n"
        "session: {body_fields: [x, meta.y]}\ngate: {high_watermark: 0.5, mode: shadow}\n"
    )
    settings = load_settings(path, {})
    assert settings.replicas == (ReplicaSettings("a", "http://h:1", 2.0),)
    assert settings.session.body_fields == ("x", "meta.y")
    assert (settings.gate.high_watermark, settings.gate.mode) == (0.5, "shadow")


def test_bare_off_is_the_gate_mode_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("gate: {mode: off}\n")
    assert load_settings(path, {}).gate.mode == "off"
    assert load_settings(None, {"KVGATE_GATE__MODE": "off"}).gate.mode == "off"
    assert any("gate.mode" in p for p in problems_of({"gate": {"mode": True}}))


def test_environment_overrides_file_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("gate: {high_watermark: 0.5}\n")
    settings = load_settings(
        path,
        {
            "KVGATE_GATE__HIGH_WATERMARK": "0.9",
            "KVGATE_ADMIN__TOKEN": "12345",
            "KVGATE_LISTEN__PORT": "9001",
            "KVGATE_BALANCER__HEALTH__UNHEALTHY_AFTER": "5",
            "KVGATE_SESSION__FORWARD_SESSION_ID": "false",
            "KVGATE_REPLICAS": "[{name: r0, url: 'http://vllm:8000'}]",
            "KVGATE_VLLM_VENV": "/elsewhere",  # the project's other variables are not settings
            "PATH": "/bin",
        },
    )
    assert settings.gate.high_watermark == 0.9
    assert settings.admin.token == "12345"  # a string setting keeps the raw text
    assert settings.listen.port == 9001
    assert settings.balancer.health.unhealthy_after == 5
    assert settings.session.forward_session_id is False
    assert settings.replicas[0].url == "http://vllm:8000"


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"nope": 1}, "nope: unknown key"),
        ({"gate": {"modez": "x"}}, "gate.modez: unknown key"),
        ({"listen": {"port": "80"}}, "listen.port: must be integer"),
        ({"listen": {"port": 70000}}, "listen.port: must be <= 65535"),
        ({"gate": {"high_watermark": 1.5}}, "gate.high_watermark: must be <= 1"),
        ({"gate": {"high_watermark": 0}}, "gate.high_watermark: must be > 0"),
        ({"gate": {"mode": "sometimes"}}, "gate.mode: must be one of enforce, shadow, off"),
        ({"gate": {"retain_session": "yes"}}, "gate.retain_session: must be boolean"),
        ({"balancer": {"algorithm": "random"}}, "balancer.algorithm: must be one of"),
        ({"balancer": {"load_factor": 0.5}}, "balancer.load_factor: must be >= 1"),
        ({"balancer": {"health": {"unhealthy_after": 0}}}, "balancer.health.unhealthy_after: must be >= 1"),
        ({"balancer": {"health": 3}}, "balancer.health: must be a mapping"),
        ({"replicas": {"name": "a"}}, "replicas: must be a list"),
        ({"replicas": [{"name": "a", "url": "ftp://x"}]}, "replicas[0].url: must be an http"),
        ({"replicas": [{"url": "http://x:1"}]}, "replicas[0].name: required key is missing"),
        ({"replicas": [{"name": "a", "url": "http://x:1", "weight": -1}]}, "replicas[0].weight: must be > 0"),
        (
            {"replicas": [{"name": "a", "url": "http://x:1"}, {"name": "a", "url": "http://y:1"}]},
            "replicas: name 'a' is used more than once",
        ),
        ({"session": {"body_fields": "session_id"}}, "session.body_fields: must be a list"),
        ({"session": {"body_fields": ["ok", 3]}}, "session.body_fields[1]: must be string"),
        ({"upstream": {"api_key": 5}}, "upstream.api_key: must be string or null"),
        ({"limits": {"max_body_bytes": 0}}, "limits.max_body_bytes: must be >= 1"),
        ({"simulated_replicas": 0}, "simulated_replicas: must be >= 1"),
    ],
)
def test_each_problem_names_its_key(data, expected):
    problems = problems_of(data)
    assert any(p.startswith(expected) for p in problems), problems


@pytest.mark.parametrize(
    "section, key, registry",
    [
        ("gate", "policy", tuple(POLICIES)),
        ("gate", "mode", MODES),
        ("balancer", "algorithm", ALGORITHMS),
        (None, "role", ROLES),
    ],
)
def test_choices_are_the_registries(section, key, registry):
    """Every name a registry knows is accepted, and the refusal lists exactly them."""

    def data(value):
        return {key: value} if section is None else {section: {key: value}}

    path = key if section is None else f"{section}.{key}"
    for name in registry:
        try:
            settings_from_dict(data(name))
        except ConfigError as exc:  # a role may need other keys; the choice itself is accepted
            assert not [p for p in exc.problems if p.startswith(f"{path}: must be one of")], name
    [problem] = [p for p in problems_of(data("no-such-choice")) if p.startswith(path + ":")]
    assert problem.startswith(f"{path}: must be one of {', '.join(registry)},")


@pytest.mark.parametrize("old,new", [("seed", "watermark"), ("contract", "working_set")])
def test_a_renamed_policy_is_refused_naming_the_new_one(old, new):
    [problem] = [p for p in problems_of({"gate": {"policy": old}}) if p.startswith("gate.policy:")]
    assert f"renamed: write {new!r}" in problem


def test_all_problems_are_reported_at_once():
    problems = problems_of({"nope": 1, "listen": {"port": "x"}, "gate": {"mode": "?"}})
    assert len(problems) == 3


def test_environment_problems_name_the_variable():
    problems = problems_of(environ={"KVGATE_GATE__HIGH_WATERMARK": "lots", "KVGATE_GATE__NOPE": "1"})
    assert any("gate.high_watermark" in p and "KVGATE_GATE__HIGH_WATERMARK" in p for p in problems)
    assert any("gate.nope" in p and "KVGATE_GATE__NOPE" in p for p in problems)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("gate: [unclosed", "not valid YAML"),
        ("- just\n- a list\n", "top level must be a mapping"),
    ],
)
def test_unreadable_files(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, {})
    assert expected in info.value.problems[0]


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_settings(tmp_path / "nope.yaml", {})
    assert "cannot read" in info.value.problems[0]


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True, timeout=60, cwd=REPO, env=env
    )


def test_check_config_ok_and_invalid(tmp_path):
    ok = run_cli("check-config", str(REPO / "configs" / "kvgate.yaml"))
    assert ok.returncode == 0, ok.stderr
    assert "ok" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: {port: -1}\ngate: {mode: nope, unknown: 1}\n")
    result = run_cli("check-config", str(bad))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3
    assert any("listen.port" in line for line in lines)
    assert any("gate.mode" in line for line in lines)
    assert any("gate.unknown" in line for line in lines)
