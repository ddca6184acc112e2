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

from kvgate.proxy.config import apply_env_overrides, load_settings, settings_from_dict

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"


def settings_from_env(env: dict[str, str]):
    """The settings a container's environment gives, checked without reading the secret files
    it names (they exist only inside the container)."""
    merged, problems, _ = apply_env_overrides({}, env)
    assert not problems, problems
    return settings_from_dict(merged)


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
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert package_dirs, "pyproject.toml maps no package folder"
    for folder in package_dirs.values():
        top = folder.split("/")[0]
        assert top in copied, f"Dockerfile does not COPY {top}"
    for source in copied:
        assert (REPO / source).exists(), f"Dockerfile copies missing {source}"
    assert load_settings(REPO / "configs" / "kvgate.yaml", {"KVGATE_LISTEN__HOST": "0.0.0.0"}).listen.host == "0.0.0.0"


def test_compose_environment_is_a_valid_kvgate_config():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    env = {k: v for k, v in compose["services"]["kvgate"]["environment"].items() if "${" not in str(v)}
    settings = settings_from_env(env)
    assert settings.replicas[0].url == "http://vllm:8100"


def _k8s_docs() -> list[dict]:
    return list(yaml.safe_load_all((DOCKER / "kubernetes-sidecar.yaml").read_text()))


def _k8s_env(container: dict, values: dict[str, str]) -> dict[str, str]:
    """A container's literal env, with Kubernetes' $(VAR) references expanded from `values`."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), item["value"])
    return env


def _config_map(docs: list[dict], name: str) -> dict:
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)
    return yaml.safe_load(cm["data"]["kvgate.yaml"])


def _mounted_config(docs: list[dict], pod_spec: dict) -> dict:
    volume = next(v for v in pod_spec["volumes"] if v["name"] == "kvgate-config")
    return _config_map(docs, volume["configMap"]["name"])


def test_kubernetes_sidecar_config_is_valid_and_runs_serve():
    docs = _k8s_docs()
    for config_map in (d for d in docs if d["kind"] == "ConfigMap"):
        settings_from_dict(yaml.safe_load(config_map["data"]["kvgate.yaml"]))
    for doc in docs:
        spec = doc["spec"]["template"]["spec"] if doc["kind"] in ("StatefulSet", "Deployment") else doc.get("spec")
        if doc["kind"] not in ("StatefulSet", "Deployment", "Pod"):
            continue
        sidecar = next(c for c in spec["containers"] if c["name"] == "kvgate")
        assert sidecar["args"] == ["serve", "--config", "/etc/kvgate/kvgate.yaml"]
        assert sidecar["securityContext"]["runAsNonRoot"] is True
        probe = sidecar["readinessProbe"]
        asked = probe["httpGet"]["path"] if "httpGet" in probe else " ".join(probe["exec"]["command"])
        assert asked.endswith("/ready") or "/ready'" in asked


def test_kubernetes_has_one_gate_per_replica_and_front_doors_that_agree():
    """Right by construction: the gate enforcing on a vLLM server is the one beside it; every
    front door routes with the gate off to exactly those gates, under the pods' names."""
    docs = _k8s_docs()
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    vllm_port = vllm["args"][vllm["args"].index("--port") + 1]
    assert vllm["args"][vllm["args"].index("--host") + 1] == "127.0.0.1"  # nothing bypasses its gate
    assert "kvgate" in next(e["value"] for e in vllm["env"] if e["name"] == "VLLM_PLUGINS")
    gate = next(c for c in pod["containers"] if c["name"] == "kvgate")
    gate_port = next(p["containerPort"] for p in gate["ports"])
    pod_names = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    for pod_name in pod_names:
        merged, problems, _ = apply_env_overrides(_mounted_config(docs, pod), _k8s_env(gate, {"POD_NAME": pod_name}))
        assert not problems
        settings = settings_from_dict(merged)
        assert settings.role == "replica_gate" and settings.gate.mode == "enforce"
        assert settings.gate.policy == "working_set"  # the default, not pinned
        assert [(r.name, r.url) for r in settings.replicas] == [(pod_name, f"http://127.0.0.1:{vllm_port}")]

    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    expected = [(name, f"http://{name}.{service['metadata']['name']}:{gate_port}") for name in pod_names]
    front_doors = [d for d in docs if d["kind"] in ("Deployment", "Pod")]
    assert {d["kind"] for d in front_doors} == {"Deployment", "Pod"}
    for doc in front_doors:
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
        settings = settings_from_dict(_mounted_config(docs, spec))
        assert (settings.role, settings.gate.mode) == ("front_door", "off")
        assert [(r.name, r.url) for r in settings.replicas] == expected
    # no kvgate config anywhere enforces on more than one replica (the old example did)
    for config_map in (d for d in docs if d["kind"] == "ConfigMap"):
        settings = settings_from_dict(yaml.safe_load(config_map["data"]["kvgate.yaml"]))
        assert settings.gate.mode == "off" or len(settings.replicas) == 1
        assert "policy" not in yaml.safe_load(config_map["data"]["kvgate.yaml"]).get("gate", {})


def test_compose_tiers_gate_per_replica_and_front_doors_agree():
    from kvgate.cli import build_parser

    compose = yaml.safe_load((DOCKER / "compose-tiers.yaml").read_text())
    services = compose["services"]
    replicas, gates, doors = {}, {}, {}
    for name, service in services.items():
        command = service.get("command")
        if command and command[0] == "replica":
            args = build_parser().parse_args(command)
            replicas[name] = f"http://{name}:{args.port}"
            continue
        settings = settings_from_env({k: str(v) for k, v in service["environment"].items()})
        {"replica_gate": gates, "front_door": doors}[settings.role][name] = settings
    assert len(replicas) == len(gates) == 2 and len(doors) == 2
    gate_names = {}
    for name, settings in gates.items():
        assert settings.gate.mode == "enforce" and len(settings.replicas) == 1
        assert settings.replicas[0].url in replicas.values()
        gate_names[f"http://{name}:{settings.listen.port}"] = settings.replicas[0].name
        assert "ready" in " ".join(services[name]["healthcheck"]["test"])
    assert len(set(s.replicas[0].url for s in gates.values())) == 2  # one gate per replica
    lists = {tuple((r.name, r.url) for r in s.replicas) for s in doors.values()}
    assert len(lists) == 1  # every front door lists the same replicas: rendezvous agrees
    (listed,) = lists
    assert sorted(listed) == sorted((gate_names[url], url) for url in gate_names)  # named like the gate's replica
    assert all(s.gate.mode == "off" for s in doors.values())


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
