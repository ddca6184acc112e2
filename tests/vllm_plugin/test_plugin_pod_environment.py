"""The plugin loads in the vLLM container of docker/kubernetes-sidecar.yaml with the
environment that pod gets with service links on (tests/proxy/test_pod_environment.py
starts the pods' kvgate containers the same way): the `kvgate` Service's `KVGATE_*`
variables beside the plugin's own."""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

import pytest

from kvgate.wire.replica_auth import OPEN_WARNING
from tests.proxy.deploy_files import VLLM_IMAGE, k8s_docs, pod_environment, pod_templates

pytestmark = pytest.mark.vllm

LOAD_THE_PLUGIN = """
import json
from fastapi import FastAPI
from vllm.plugins import load_general_plugins
from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins
load_general_plugins()
app = FastAPI()
attach_endpoint_plugins(app, ("generate",))
print(json.dumps(sorted({route.path for route in app.routes if "/kvgate/" in route.path})))
"""


def test_the_plugin_loads_with_the_vllm_pods_environment(vllm_python: Path, tmp_path: Path):
    docs = k8s_docs()
    ((pod_name, pod),) = [
        (name, pod) for name, pod in pod_templates(docs) if any(c["name"] == "vllm" for c in pod["containers"])
    ]
    container = next(c for c in pod["containers"] if c["name"] == "vllm")
    services = [d for d in docs if d["kind"] == "Service"]
    env = pod_environment(pod_name, container, services, VLLM_IMAGE.env)
    assert "KVGATE_SERVICE_PORT_HTTP" in env and env["VLLM_PLUGINS"] == "kvgate"
    key_file = tmp_path / "replica.key"
    key_file.write_text(secrets.token_hex(24) + "\n")
    env = {name: value.replace("/etc/kvgate-keys", str(tmp_path)) for name, value in env.items()}
    done = subprocess.run(
        [str(vllm_python), "-c", LOAD_THE_PLUGIN], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [
        "/v1/kvgate/kv",
        "/v1/kvgate/owner",
        "/v1/kvgate/prefix",
        "/v1/kvgate/release",
    ]
    assert OPEN_WARNING not in done.stdout + done.stderr  # the key file was read
