"""What the container files run, read the way Docker, Compose and Kubernetes read them.

No Docker engine or cluster runs here, so the deploy tests derive from each file what
every container would run, and where it would listen, from the same code the program
runs: kvgate's own config loader for `kvgate serve` (image config, mounted ConfigMap,
environment, flags), kvgate's argument parser for `kvgate replica`, and vLLM's
documented defaults for vLLM's flags. Probes and healthchecks are then checked against
those addresses, with where each one is sent from (inside the container, or from the
kubelet to the pod IP).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvgate.proxy.config import apply_env_overrides, read_yaml, settings_from_dict

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
ANY_ADDRESS = ("0.0.0.0", "::", "")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# vLLM's OpenAI server: `--host` unset binds every interface, `--port` defaults to 8000.
VLLM_DEFAULT_HOST, VLLM_DEFAULT_PORT = "0.0.0.0", 8000
_URL = re.compile(r"https?://([\w.\-\[\]:]+?):(\d+)(/[\w/\-]*)?")


@dataclass(frozen=True)
class Listen:
    """A socket a container listens on."""

    host: str
    port: int

    def reachable_from_inside(self) -> bool:
        """A probe run inside the container (exec, Docker HEALTHCHECK) can reach it on loopback."""
        return self.host in ANY_ADDRESS or self.host in LOOPBACK

    def reachable_from_network(self) -> bool:
        """The kubelet (pod IP), a Service, another container or a published port can reach it."""
        return self.host in ANY_ADDRESS


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    base: str
    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str] | None  # the command, as exec-form words
    copies: list[tuple[str, str]]  # (source in the repository, destination in the image)

    def copied(self) -> set[str]:
        return {source for source, _ in self.copies}

    def files(self) -> dict[str, Path]:
        """The image's paths of the single files it copies, mapped to the repository's files."""
        return {dest: REPO / source for source, dest in self.copies if not dest.endswith("/")}


def read_dockerfile(path: Path) -> Dockerfile:
    text = path.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    cmd: list[str] = []
    healthcheck = None
    copies: list[tuple[str, str]] = []
    base = ""
    for op, args in re.findall(r"^(\w+)\s+(.*)$", text, re.M):
        op = op.upper()
        if op == "FROM":
            base = args.split()[0]
        elif op == "ENV":
            for word in shlex.split(args):
                key, _, value = word.partition("=")
                env[key] = value
        elif op == "ENTRYPOINT":
            entrypoint = json.loads(args)
        elif op == "CMD":
            cmd = json.loads(args)
        elif op == "HEALTHCHECK":
            healthcheck = shlex.split(args.split(" CMD ", 1)[1])
        elif op == "COPY":
            *sources, dest = args.split()
            copies += [(source, dest) for source in sources]
    return Dockerfile(path, base, env, entrypoint, cmd, healthcheck, copies)


KVGATE_IMAGE = read_dockerfile(DOCKER / "Dockerfile")
VLLM_IMAGE = read_dockerfile(DOCKER / "vllm.Dockerfile")
DOCKERFILES = {"docker/Dockerfile": KVGATE_IMAGE, "docker/vllm.Dockerfile": VLLM_IMAGE}


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in `args`."""
    for i, word in enumerate(args):
        if word == name and i + 1 < len(args):
            return args[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def kvgate_listen(argv: list[str], env: dict[str, str], files: dict[str, Path]) -> Listen:
    """Where `kvgate ARGV` listens with environment `env`; `files` maps the container's
    paths to the repository files mounted or copied there."""
    from kvgate.cli import build_parser

    args = build_parser().parse_args(argv)
    if args.command == "replica":
        return Listen(args.host, args.port)
    assert args.command == "serve", argv
    data = read_yaml(files[args.config]) if args.config else {}
    merged, problems, _ = apply_env_overrides(data, {k: v for k, v in env.items() if k.startswith("KVGATE_")})
    assert not problems, problems
    listen = settings_from_dict(merged).listen
    return Listen(args.host or listen.host, args.port if args.port is not None else listen.port)


def vllm_listen(args: list[str]) -> Listen:
    port = flag(args, "--port")
    return Listen(flag(args, "--host") or VLLM_DEFAULT_HOST, int(port) if port else VLLM_DEFAULT_PORT)


def image_listen(image: Dockerfile, command: list[str] | None, env: dict[str, str], files: dict[str, Path]) -> Listen:
    """Where a container of `image` listens, given its command (None: the image's CMD)."""
    argv = list(command if command is not None else image.cmd)
    env = {**image.env, **env}
    if image is VLLM_IMAGE:
        return vllm_listen(argv)
    assert image.entrypoint == ["kvgate"], image.entrypoint
    files = {**image.files(), **files}
    return kvgate_listen(argv, env, files)


def probe_url(words: list[str]) -> tuple[str, int, str]:
    """(host, port, path) of the one URL a probe command asks."""
    found = _URL.findall(" ".join(words))
    assert len(found) == 1, f"a probe command should ask one URL: {words}"
    host, port, path = found[0]
    return host, int(port), path or "/"


def compose(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


def k8s_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all((DOCKER / "kubernetes-sidecar.yaml").read_text()) if d]


# ---- the environment the kubelet gives a container -----------------------------------


def service_link_variables(service: dict, cluster_ip: str) -> dict[str, str]:
    """The legacy service-link variables of `service`, as the kubelet writes them
    (pkg/kubelet/envvars: `NAME_SERVICE_HOST`, `NAME_SERVICE_PORT[_PORTNAME]`, and the
    Docker-links `NAME_PORT`, `NAME_PORT_<port>_<PROTO>[_PROTO|_PORT|_ADDR]`); none for a
    headless Service (`clusterIP: None`)."""
    if service["spec"].get("clusterIP") == "None":
        return {}
    name = service["metadata"]["name"].upper().replace("-", "_")
    ports = service["spec"]["ports"]
    host = f"[{cluster_ip}]" if ":" in cluster_ip else cluster_ip
    env = {f"{name}_SERVICE_HOST": cluster_ip, f"{name}_SERVICE_PORT": str(ports[0]["port"])}
    for port in ports:
        if port.get("name"):
            env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
    for i, port in enumerate(ports):
        protocol = port.get("protocol", "TCP")
        url = f"{protocol.lower()}://{host}:{port['port']}"
        if i == 0:
            env[f"{name}_PORT"] = url
        prefix = f"{name}_PORT_{port['port']}_{protocol.upper()}"
        env |= {prefix: url, f"{prefix}_PROTO": protocol.lower(), f"{prefix}_PORT": str(port["port"])}
        env[f"{prefix}_ADDR"] = cluster_ip
    return env


def pod_environment(pod_name: str, container: dict, services: list[dict], image_env: dict[str, str]) -> dict[str, str]:
    """What a container of pod `pod_name` finds in its environment with service links on:
    the image's ENV, under every Service's links, under the container's own `env` entries
    with `$(VAR)` expanded from what is defined before them (the kubelet's order)."""
    env = dict(image_env)
    for i, service in enumerate(services):
        env |= service_link_variables(service, f"10.96.0.{10 + i}")
    field_values = {"metadata.name": pod_name, "metadata.namespace": "default"}
    for item in container.get("env", []):
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        else:
            value = field_values[item["valueFrom"]["fieldRef"]["fieldPath"]]
        env[item["name"]] = value
    return env


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(the name of one pod it makes, pod spec) of every Pod, Deployment and StatefulSet."""
    out = []
    for doc in docs:
        name = doc["metadata"]["name"]
        if doc["kind"] == "StatefulSet":
            out.append((f"{name}-0", doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "Deployment":
            out.append((f"{name}-5d8f7c9b6-x2k4q", doc["spec"]["template"]["spec"]))
        elif doc["kind"] == "Pod":
            out.append((name, doc["spec"]))
    return out
