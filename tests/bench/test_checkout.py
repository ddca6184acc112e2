"""bench/checkout.py: the link tree that imports `kvgate.*` from a checkout's folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.bench.checkout import import_tree, package_dirs

REPO = Path(__file__).resolve().parents[2]


def test_the_tree_imports_this_checkouts_folders(tmp_path):
    root = import_tree(REPO, tmp_path / "tree")
    assert (root / "kvgate" / "vllm_plugin").resolve() == (REPO / "vllm_plugin").resolve()
    assert (root / "kvgate" / "bench" / "agentic").resolve() == (REPO / "bench" / "agentic").resolve()
    assert not (root / "kvgate" / "__init__.py").exists()  # kvgate stays a namespace package
    printed = subprocess.run(
        [sys.executable, "-c", "import kvgate.cli as m; print(m.__file__)"],
        env={"PYTHONPATH": str(root)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert printed == str(root / "kvgate" / "cli" / "__init__.py")


def test_a_checkout_from_before_the_namespace_maps_nothing(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "kvgate"\n[tool.setuptools]\npackages = ["proxy"]\n')
    assert package_dirs(tmp_path) == {}
    with pytest.raises(ValueError, match="maps no kvgate"):
        import_tree(tmp_path, tmp_path / "tree")


def test_a_nested_package_outside_its_parents_folder_is_refused(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"kvgate.bench" = "bench"\n"kvgate.bench.agentic" = "agentic"\n'
    )
    with pytest.raises(ValueError, match="not under kvgate.bench"):
        import_tree(tmp_path, tmp_path / "tree")
