"""The plugin's one install path, as a user takes it: the README's install commands, run as
written from a fresh clone (from the checkout, then from the wheel they build), into a
vLLM environment of their own, and the vLLM server the README starts answers the probes.

The environment is a fresh virtual environment that sees the test vLLM environment's
packages (a .pth file) and nothing of kvgate: everything of kvgate in it comes from the
README's commands, which install into it and not into the shared test environment.
"""

from __future__ import annotations

import glob
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_harness import REPO_ROOT, TEST_LAYOUT_ARGS, TEST_LAYOUT_ENV, VllmServer, http_json

pytestmark = pytest.mark.vllm

README_PYTHON = "/opt/vllm/bin/python"  # the placeholder the README's commands use


def readme_install_block(readme: Path) -> list[str]:
    """The command lines of the first bash block under "Installing the vLLM plugin"."""
    text = readme.read_text()
    section = text[text.index("### Installing the vLLM plugin") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README: no bash block under 'Installing the vLLM plugin'"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def vllm_environment(vllm_python: Path, where: Path) -> Path:
    """A new venv whose python imports the test vLLM environment's packages but no kvgate."""
    purelib = subprocess.run(
        [str(vllm_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    (site,) = where.glob("lib/python3*/site-packages")
    (site / "_vllm_packages.pth").write_text(purelib + "\n")
    return where / "bin" / "python"


def installed_plugin(python: Path, cwd: Path) -> dict:
    """Where the environment's kvgate plugin is installed from, asked with `python -I` from `cwd`."""
    check = (
        "import json, importlib.metadata as m, kvgate.vllm_plugin as p;"
        "d = m.distribution('kvgate');"
        "print(json.dumps({'package': list(p.__path__), 'direct_url': d.read_text('direct_url.json')}))"
    )
    out = subprocess.run([str(python), "-I", "-c", check], capture_output=True, text=True, cwd=cwd, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_readme_install_commands_from_a_fresh_clone_give_a_vllm_with_the_probes(
    vllm_python: Path, tiny_model: Path, tmp_path: Path
):
    clone = tmp_path / "kvgate"
    subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    python = vllm_environment(vllm_python, tmp_path / "vllm-env")
    lines = readme_install_block(clone / "README.md")
    *install, start = lines
    assert any("install-vllm-plugin.sh" in line and ".whl" not in line for line in install), lines
    assert any(line.startswith("python3 -m pip wheel") for line in install), lines
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    for line in install:
        done = subprocess.run(
            ["bash", "-c", line.replace(README_PYTHON, str(python))],
            cwd=clone,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, f"README command failed: {line}\n{done.stdout}\n{done.stderr}"
        if "install-vllm-plugin.sh" in line:
            assert "ready for vLLM 0.32" in done.stdout, done.stdout + done.stderr
            found = installed_plugin(python, empty)
            site = str(next((tmp_path / "vllm-env").glob("lib/python3*/site-packages")))
            assert all(path.startswith(site) for path in found["package"]), found  # in the new env, not a checkout
            wheel = ".whl" in line
            url = json.loads(found["direct_url"] or "{}").get("url", "")
            assert url.endswith(".whl") if wheel else url == clone.as_uri(), (line, url)
    assert glob.glob(str(clone / "dist" / "kvgate-*.whl"))

    # the README's start command, with the test's model and cache for MODEL
    words = shlex.split(start.replace(README_PYTHON, str(python)))
    assert words[:5] == ["VLLM_PLUGINS=kvgate", str(python), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    # in the shared test servers' layout (conftest.py): what the install gives is the same
    # in vLLM's default one, which test_bench_pinning.py starts
    server = VllmServer(
        python=python,
        model_dir=tiny_model,
        log_path=tmp_path / "vllm.log",
        served_model_name="tiny",
        extra_args=TEST_LAYOUT_ARGS,
        extra_env=TEST_LAYOUT_ENV,
    )
    assert server.command()[:4] == words[1:5] and server.environment()["VLLM_PLUGINS"] == "kvgate"
    # the usage the gate learns prefix hits from (docs/vllm-plugin.md), in the README and in every test server
    assert "--enable-prompt-tokens-details" in words and "--enable-prompt-tokens-details" in server.command()
    server.start()
    try:
        status, kv = http_json("GET", server.url + "/v1/kvgate/kv")
        assert status == 200 and kv["num_total_blocks"] > 0, kv
        status, prefix = http_json("POST", server.url + "/v1/kvgate/prefix", {"token_ids": list(range(1, 100))})
        assert status == 200 and prefix["total_blocks"] >= 3, prefix
        log = server.log_tail(400)
        assert "is not supported" not in log
    finally:
        server.stop()
