"""ruff (lint and format) and mypy over the repository, as CI runs them (config: pyproject.toml).

These run inside the test command so that `.ci/run`, which runs exactly the README's test
command, runs them too. A developer can skip them with `-m "not static"`.

mypy checks the installed package, `kvgate.*`, and not tests/: the tests are checked by
running them (a wrong type there fails the test that uses it), they are mostly fixtures and
fakes that pytest wires by name, which mypy cannot follow, and annotating them would type
the fakes rather than the product.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.bench.checkout import import_tree, package_dirs

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.static


def run_tool(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_ruff_lint_passes():
    result = run_tool("ruff", "check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    result = run_tool("ruff", "format", "--check", ".")
    assert result.returncode == 0, "run `.venv/bin/ruff format`:\n" + result.stdout + result.stderr


def test_mypy_passes(tmp_path):
    root = import_tree(REPO, tmp_path / "layout")  # the editable install's import hook is invisible to mypy
    result = run_tool(
        "mypy",
        "--config-file",
        str(REPO / "pyproject.toml"),
        "--cache-dir",
        str(tmp_path / "mypy_cache"),
        "-p",
        "kvgate",
        cwd=root,
        env={**os.environ, "MYPYPATH": str(root)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # every module of the package was checked, none skipped by the layout
    modules = {path.resolve() for part in package_dirs(REPO).values() for path in part.rglob("*.py")}
    checked = re.search(r"Success: no issues found in (\d+) source files", result.stdout)
    assert checked and int(checked.group(1)) == len(modules) + 1, result.stdout  # + the namespace `kvgate`
