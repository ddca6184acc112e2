"""The container files: the image runs the command the tests run, with configs that validate.

No Docker engine runs here, so the image is never built; these checks keep the files
consistent with the code.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml

from proxy.config import load_settings, settings_from_dict

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", text, re.M)]


def test_image_command_is_serve_with_the_config_path():
    instructions = dict(dockerfile_instructions())
    command = json.loads(instructions["ENTRYPOINT"]) + json.loads(instructions["CMD"])
    assert command == ["kvgate", "serve", "--config", "/etc/kvgate/kvgate.yaml"]
    assert instructions["USER"] != "root" and instructions["USER"] != "0"


def test_image_copies_every_package_and_a_valid_config():
    copied = {args.split()[0] for op, args in dockerfile_instructions() if op == "COPY"}
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in packages:
        assert pattern.rstrip("*") in copied, f"Dockerfile does not COPY {pattern}"
    for source in copied:
        assert (REPO / source).exists(), f"Dockerfile copies missing {source}"
    assert load_settings(REPO / "configs" / "kvgate.yaml", {"KVGATE_LISTEN__HOST": "0.0.0.0"}).listen.host == "0.0.0.0"


def test_compose_environment_is_a_valid_kvgate_config():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    env = {k: v for k, v in compose["services"]["kvgate"]["environment"].items() if "${" not in str(v)}
    settings = load_settings(None, env)
    assert settings.replicas[0].url == "http://vllm:8100"


def test_kubernetes_sidecar_config_is_valid_and_runs_serve():
    docs = list(yaml.safe_load_all((DOCKER / "kubernetes-sidecar.yaml").read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    settings = settings_from_dict(yaml.safe_load(config_map["data"]["kvgate.yaml"]))
    assert len(settings.replicas) == 2
    pod = next(d for d in docs if d["kind"] == "Pod")
    sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "kvgate")
    assert sidecar["args"] == ["serve", "--config", "/etc/kvgate/kvgate.yaml"]
    assert sidecar["securityContext"]["runAsNonRoot"] is True
