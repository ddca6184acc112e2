"""The vLLM venv's "is this checkout installed" check (no vLLM needed: these run everywhere).

The check once ran `python -c` with the repository as its working directory, where
`vllm_plugin` imports from the working directory and `kvgate.egg-info` supplies the
entry points, so it answered yes for a venv without kvgate, and vLLM then started
without the plugin on every fresh machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from vllm_harness import REPO_ROOT, _repo_installed, installed_checkout

HERE = {"url": REPO_ROOT.resolve().as_uri(), "dir_info": {"editable": True}}
PACKAGE = str((REPO_ROOT / "vllm_plugin").resolve())


@pytest.mark.parametrize(
    "report, expected",
    [
        (None, False),  # kvgate not installed at all
        ({"direct_url": HERE, "package": PACKAGE, "general": True, "endpoint": True}, True),
        ({"direct_url": HERE, "package": PACKAGE, "general": True, "endpoint": False}, False),
        ({"direct_url": HERE, "package": PACKAGE, "general": False, "endpoint": True}, False),
        (
            {"direct_url": {"url": "file:///elsewhere/kvgate"}, "package": PACKAGE, "general": True, "endpoint": True},
            False,
        ),  # another checkout is installed
        ({"direct_url": None, "package": PACKAGE, "general": True, "endpoint": True}, False),  # a wheel install
        ({"direct_url": HERE, "package": "/elsewhere/vllm_plugin", "general": True, "endpoint": True}, False),
    ],
)
def test_installed_checkout_table(report, expected):
    assert installed_checkout(report, REPO_ROOT) is expected


def test_a_venv_without_kvgate_is_not_taken_for_one_with_it(tmp_path, monkeypatch):
    """A bare venv, checked while the test process sits in the checkout (as pytest does),
    with the checkout's kvgate.egg-info and vllm_plugin right there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    assert not _repo_installed(Path(tmp_path / "venv" / "bin" / "python"))
