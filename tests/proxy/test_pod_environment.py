"""Each shipped kvgate container started as its Kubernetes pod would start it.

A pod gets more environment than its manifest writes: with service links on (the
default), the kubelet adds the variables of every Service with a cluster IP in the
namespace, and a Service named `kvgate` puts them in kvgate's own `KVGATE_` namespace.
These tests derive each container's environment from docker/kubernetes-sidecar.yaml as
the kubelet would (tests/proxy/deploy_files.py), add Services named `kvgate-door` and
`kvgate-admin` as a user might, and start the container's command with it, against
simulated replicas, as the pod's security context asks where the machine allows it:
user 10001, a read-only root file system, no home directory.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from kvgate.proxy.config import ConfigError, load_settings, setting_variables
from kvgate.proxy.service_links import is_service_link
from kvgate.simulator.replica_server import build_replica_app
from tests.proxy.deploy_files import KVGATE_IMAGE, k8s_docs, pod_environment, pod_templates, service_link_variables
from tests.proxy.serve_process import start_until_listening

# Services a user might add beside the shipped ones: more names in kvgate's namespace.
USERS_SERVICES = [
    {"kind": "Service", "metadata": {"name": name}, "spec": {"ports": ports}}
    for name, ports in (
        ("kvgate-door", [{"name": "http", "port": 8000}, {"name": "metrics-port", "port": 9100, "protocol": "UDP"}]),
        ("kvgate-admin", [{"port": 8001}]),
    )
]
CONFIG_MOUNT = "/etc/kvgate/kvgate.yaml"
KEYS_MOUNT = "/etc/kvgate-keys"


def _services() -> list[dict]:
    return [d for d in k8s_docs() if d["kind"] == "Service"] + USERS_SERVICES


def _link_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for i, service in enumerate(_services()):
        env |= service_link_variables(service, f"10.96.0.{10 + i}")
    return env


def _kvgate_containers() -> list[tuple[str, dict, dict]]:
    return [
        (pod_name, pod, container)
        for pod_name, pod in pod_templates(k8s_docs())
        for container in pod["containers"]
        if container["image"].startswith("kvgate:")
    ]


def test_the_shipped_services_put_variables_in_kvgates_namespace():
    """The premise: without this, the rest would test nothing."""
    env = _link_environment()
    assert env["KVGATE_SERVICE_PORT_HTTP"] == "8000" and env["KVGATE_PORT"].startswith("tcp://10.96.0.")
    assert env["KVGATE_DOOR_PORT_9100_UDP_PROTO"] == "udp" and "KVGATE_ADMIN_PORT_8001_TCP_ADDR" in env
    assert not [name for name in env if name.startswith("VLLM_")], "the vllm Service is headless: no links"


def test_kvgate_loads_with_every_services_links():
    settings = load_settings(None, _link_environment())
    assert settings.listen.port == 8000


def test_ipv6_service_links_are_recognised_too():
    service = {"metadata": {"name": "kvgate"}, "spec": {"ports": [{"name": "http", "port": 8000}]}}
    env = service_link_variables(service, "fd00:10:96::a")
    assert env["KVGATE_PORT"] == "tcp://[fd00:10:96::a]:8000"
    load_settings(None, env)


@pytest.mark.parametrize(
    "variable, value, problem",
    [
        ("KVGATE_GATE__POLICI", "working_set", "gate.polici: unknown key (did you mean gate.policy?)"),
        ("KVGATE_LISTEN__PORTS", "tcp://10.96.0.10:8000", "listen.ports: unknown key (did you mean listen.port?)"),
        # named like a link, valued like a setting
        ("KVGATE_LISTEN_PORT", "9000", "KVGATE_LISTEN_PORT: not a kvgate setting (did you mean KVGATE_LISTEN__PORT?)"),
        ("KVGATE_GATE_POLICY", "tcp", "KVGATE_GATE_POLICY: not a kvgate setting (did you mean KVGATE_GATE__POLICY?)"),
    ],
)
def test_a_misspelt_setting_is_still_named_beside_the_links(variable, value, problem):
    with pytest.raises(ConfigError) as caught:
        load_settings(None, {**_link_environment(), variable: value})
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith(problem) and variable in caught.value.problems[0]


@pytest.mark.parametrize(
    "name, value",
    [
        ("KVGATE_PORT", "8000"),  # NAME_PORT holds a URL
        ("KVGATE_SERVICE_HOST", "kvgate.default.svc"),  # an address, never a host name
        ("KVGATE_SERVICE_PORT", "70000"),
        ("KVGATE_PORT_8000_TCP_PROTO", "http"),
        ("KVGATE_PORT_8000_HTTP", "tcp://10.0.0.1:8000"),  # no such protocol
    ],
)
def test_a_link_shaped_name_with_another_value_is_not_a_link(name, value):
    assert not is_service_link(name, value)


def test_no_setting_could_be_taken_for_a_service_link():
    values = ("10.96.0.10", "8000", "tcp://10.96.0.10:8000", "tcp")
    assert not [v for v in setting_variables() for value in values if is_service_link(v, value)]


def test_every_shipped_pod_turns_service_links_off():
    templates = pod_templates(k8s_docs())
    assert len(templates) == 3
    assert [name for name, pod in templates if pod.get("enableServiceLinks") is not False] == []


# ---- the containers, started ------------------------------------------------------------


def _can_sandbox() -> bool:
    """A private mount namespace and a user switch need root, unshare and setpriv."""
    return os.geteuid() == 0 and bool(shutil.which("unshare")) and bool(shutil.which("setpriv"))


def _as_the_pod_runs_it(argv: list[str], security: dict) -> list[str]:
    """`argv` as user `runAsUser` on a read-only root file system (a private mount
    namespace remounts / read-only). The user keeps CAP_DAC_READ_SEARCH, so it can read
    this checkout and its interpreter wherever they are (the image has them world-readable
    under /opt and /usr), but it writes nowhere the image would not let it."""
    uid = str(security["runAsUser"])
    assert security["readOnlyRootFilesystem"] is True and security["runAsNonRoot"] is True
    switch = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    switch += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    script = 'mount -o remount,bind,ro / && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *switch, *argv]


def _replica_urls(config: dict, env: dict[str, str]) -> list[str]:
    urls = [r["url"] for r in config.get("replicas", [])]
    return urls + re.findall(r'url: "([^"]+)"', env.get("KVGATE_REPLICAS", ""))


def _laid_out(text: str, keys: Path, sims: dict[str, str]) -> str:
    """Text of the pod's config or environment, with its mounts and replicas made local."""
    text = text.replace(KEYS_MOUNT, str(keys))
    for url, sim in sims.items():
        text = text.replace(url, sim)
    return text


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    """The `kvgate-keys` Secret, readable by the pod's user as the Secret's 0444 mode makes it."""
    keys = tmp_path / "keys"
    keys.mkdir()
    for name in ("replica.key", "door.key"):
        (keys / name).write_text(secrets.token_hex(24) + "\n")
        (keys / name).chmod(0o444)
    for path in (tmp_path, keys):
        path.chmod(0o755)
    return keys


async def _wait_for_health(url: str, proc: asyncio.subprocess.Process, lines: list[str]) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            if proc.returncode is not None:
                break
            try:
                async with http.get(url + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("no /health answer:\n" + "".join(lines))


@pytest.mark.parametrize(
    "pod_name, pod, container", _kvgate_containers(), ids=[f"{name}/{c['name']}" for name, _, c in _kvgate_containers()]
)
async def test_each_kvgate_container_starts_with_its_pods_environment(
    pod_name, pod, container, keys_dir: Path, tmp_path: Path, aiohttp_server
):
    replica_key = (keys_dir / "replica.key").read_text().strip()
    env = {**pod_environment(pod_name, container, _services(), KVGATE_IMAGE.env), **_link_environment()}
    assert "KVGATE_SERVICE_PORT_HTTP" in env and pod.get("enableServiceLinks") is False  # on, as if unset
    config_map = next(v for v in pod["volumes"] if v["name"] == "kvgate-config")["configMap"]["name"]
    config_text = next(d for d in k8s_docs() if d["metadata"]["name"] == config_map)["data"]["kvgate.yaml"]
    urls = _replica_urls(yaml.safe_load(config_text), env)
    sims = {}
    for url in dict.fromkeys(urls):
        server = await aiohttp_server(build_replica_app(time_scale=0, replica_api_key=replica_key))
        sims[url] = str(server.make_url("")).rstrip("/")
    config = yaml.safe_load(_laid_out(config_text, keys_dir, sims))
    config["listen"]["port"] = 0  # the pod's 8000 may be taken on this machine
    config_file = tmp_path / "kvgate.yaml"
    config_file.write_text(yaml.safe_dump(config))
    config_file.chmod(0o444)
    env = {name: _laid_out(value, keys_dir, sims) for name, value in env.items()}
    env |= {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent"}
    argv = [
        sys.executable,
        "-m",
        "kvgate.cli",
        *[str(config_file) if a == CONFIG_MOUNT else a for a in container["args"]],
    ]
    workdir = tmp_path / "workdir"  # the image's WORKDIR: nothing of kvgate's may be written there
    workdir.mkdir(mode=0o555)
    if _can_sandbox():
        argv = _as_the_pod_runs_it(argv, container["securityContext"])
    proc, lines, url = await start_until_listening(argv, env, workdir)
    url = url.replace("0.0.0.0", "127.0.0.1")
    try:
        await _wait_for_health(url, proc, lines)
        if _can_sandbox():
            uid = re.search(r"^Uid:\s+(\d+)", Path(f"/proc/{proc.pid}/status").read_text(), re.M)
            assert uid and uid.group(1) == str(container["securityContext"]["runAsUser"])
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), timeout=30)
    rest = (await proc.stdout.read()).decode()
    assert code == 0, "".join(lines) + rest
    assert list(workdir.iterdir()) == []
