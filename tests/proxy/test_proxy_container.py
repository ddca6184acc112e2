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


def test_compose_observability_services_mount_files_that_exist_and_agree():
    """Prometheus and Grafana in the compose example (docs/observability.md): every mounted
    file exists, Prometheus scrapes the compose services kvgate and vllm at their ports and
    loads the rules where they are mounted, Grafana's datasource is that Prometheus and its
    dashboard provider reads the directory the dashboard is mounted in."""
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            assert (DOCKER / source).exists(), f"{name} mounts missing {source}"
            mounts[target] = DOCKER / source
    prometheus = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    assert all(path in mounts for path in prometheus["rule_files"])
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    kvgate_port = load_settings(None, {"KVGATE_LISTEN__HOST": "0.0.0.0"}).listen.port
    vllm_port = services["vllm"]["command"][services["vllm"]["command"].index("--port") + 1]
    assert targets == {f"kvgate:{kvgate_port}", f"vllm:{vllm_port}"}
    vllm_job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "vllm")
    kvgate_env = services["kvgate"]["environment"]
    replica_names = {r.name for r in load_settings(None, {"KVGATE_REPLICAS": kvgate_env["KVGATE_REPLICAS"]}).replicas}
    assert {c["labels"]["replica"] for c in vllm_job["static_configs"]} <= replica_names
    assert services["prometheus"]["ports"] == ["9090:9090"]  # the port Grafana's datasource uses

    provisioning = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "kvgate.yml").read_text())["providers"][0]
    dashboard_path = next(t for t in mounts if t.endswith("kvgate.json"))
    assert dashboard_path.startswith(provider["options"]["path"].rstrip("/") + "/")
    dashboard = json.loads(mounts[dashboard_path].read_text())
    assert dashboard["uid"] == "kvgate"
    assert services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_path
