"""ruff (lint and format) over the whole repository, as CI runs it (config: pyproject.toml).

These run inside the test command so that `.ci/run`, which runs exactly the README's test
command, runs them too. A developer can skip them with `-m "not static"`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.static


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_lint_passes():
    result = run_tool("ruff", "check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    result = run_tool("ruff", "format", "--check", ".")
    assert result.returncode == 0, "run `.venv/bin/ruff format`:\n" + result.stdout + result.stderr
