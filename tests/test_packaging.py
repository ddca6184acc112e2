"""The wheel: it installs one top-level import name, `kvgate`, and its entry points (the
`kvgate` console script, the vLLM plugins) name objects that import from it.

The plugin's install (`docker/install-vllm-plugin.sh`) puts kvgate into vLLM's own
environment: a top-level `proxy`, `gate`, `bench` or `simulator` there could shadow, or
be shadowed by, other distributions of those names (docs/ARCHITECTURE.md, Packaging).
The wheel is built as pip builds it for a user (in an isolated environment with
pyproject.toml's [build-system] requirements), from a copy of the checkout, so the build
leaves nothing in the working tree.
"""

from __future__ import annotations

import configparser
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# One worker runs this file's tests: the module's wheel is built once (4-7 s), not once per worker.
pytestmark = pytest.mark.xdist_group("packaging")

# group -> the entry point kvgate must register in it
ENTRY_POINTS = {
    "console_scripts": "kvgate",
    "vllm.general_plugins": "kvgate",
    "vllm.endpoint_plugins": "kvgate",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source") / "kvgate"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "results", ".pytest_cache"
        ),
    )
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("kvgate-*.whl")
    return path


def test_the_wheel_installs_only_the_kvgate_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    dist_info = {name for name in top if name.endswith(".dist-info")}
    assert len(dist_info) == 1, top
    assert top - dist_info == {"kvgate"}, f"top-level names besides kvgate: {sorted(top - dist_info - {'kvgate'})}"
    assert "kvgate/__init__.py" not in names  # a namespace package (PEP 420): nothing of its own
    for module in (
        "kvgate/cli/__init__.py",
        "kvgate/gate/gate.py",
        "kvgate/gate/policies/registry.py",
        "kvgate/balancer/balancer.py",
        "kvgate/simulator/replica_server.py",
        "kvgate/simulator/virtual_engine.py",
        "kvgate/bench/agentic/cli.py",
        "kvgate/bench/cluster/run.py",
        "kvgate/vllm_plugin/engine_plugin.py",
        "kvgate/wire/probe_api.py",
        # the status page's files (package data): GET /admin/ui serves them from the package
        "kvgate/proxy/status-page/index.html",
        "kvgate/proxy/status-page/app.js",
        "kvgate/proxy/status-page/style.css",
    ):
        assert module in names, module
    assert not any(name.startswith("kvgate/tests") or "/tests/" in name for name in names)
    assert not any(name.startswith("kvgate/simulator/cluster/") for name in names)  # the cluster is bench's


def entry_points_of(wheel: Path) -> configparser.ConfigParser:
    with zipfile.ZipFile(wheel) as archive:
        (path,) = [name for name in archive.namelist() if name.endswith(".dist-info/entry_points.txt")]
        text = archive.read(path).decode()
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # entry point names are case-sensitive
    parser.read_string(text)
    return parser


def test_the_entry_points_name_importable_kvgate_objects(wheel, tmp_path):
    entry_points = entry_points_of(wheel)
    targets = {}
    for group, name in ENTRY_POINTS.items():
        assert entry_points.has_option(group, name), f"no {group} entry point {name!r}"
        target = entry_points.get(group, name).strip()
        assert target.startswith("kvgate."), f"{group} {name} = {target}: not in the kvgate namespace"
        targets[group] = target
    # Import them from the unpacked wheel (first on the path), not from this checkout.
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    probe = (
        "import importlib, json, sys\n"
        "found = {}\n"
        "for group, target in json.loads(sys.argv[1]).items():\n"
        "    module_name, _, attribute = target.partition(':')\n"
        "    module = importlib.import_module(module_name)\n"
        "    obj = getattr(module, attribute)\n"
        "    found[group] = [module.__file__, callable(obj)]\n"
        "print(json.dumps(found))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(targets)],
        env={"PYTHONPATH": str(unpacked)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for group, (module_file, is_callable) in found.items():
        assert Path(module_file).is_relative_to(unpacked), (group, module_file)
        assert is_callable, group


def test_loading_the_vllm_plugin_imports_no_other_part():
    """What vLLM loads through the entry points pulls in the plugin and the wire contract
    alone: nothing of the proxy, gate, balancer, simulator or benchmarks, and no aiohttp
    (docs/ARCHITECTURE.md)."""
    probe = (
        "import json, sys\n"
        "import kvgate.vllm_plugin.endpoint_plugin, kvgate.vllm_plugin.engine_plugin\n"
        "print(json.dumps(sorted(name for name in sys.modules if name.startswith(('kvgate.', 'aiohttp')))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert any(name.startswith("kvgate.vllm_plugin.") for name in loaded), loaded
    assert [name for name in loaded if not name.startswith(("kvgate.vllm_plugin", "kvgate.wire"))] == [], loaded
