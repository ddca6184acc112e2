"""Importing `kvgate.*` from a checkout's folders, as the wheel would install them.

The repository keeps its parts in top-level folders (proxy/, gate/, ...) that setuptools
installs as `kvgate.proxy`, `kvgate.gate`, ... (pyproject.toml, [tool.setuptools.package-dir]).
A tool that must import a checkout without installing it (mypy over this one, the
overhead benchmark's `--baseline-repo` over another) reads it through a tree of links
laid out the same way.
"""

from __future__ import annotations

import tomllib
from pathlib import Path


def package_dirs(repo: Path) -> dict[str, Path]:
    """`kvgate.x` -> the folder of checkout `repo` that setuptools installs it from; empty for
    a checkout from before the namespace (its packages are top-level)."""
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    mapping = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return {name: repo / folder for name, folder in mapping.items() if name.startswith("kvgate.")}


def import_tree(repo: Path, root: Path) -> Path:
    """Lay out `root/kvgate/<part>` -> the folders of `repo`; return `root` (put it first on
    the import path). A package nested in a mapped one (`kvgate.bench.agentic`) comes with
    its parent's link, so its folder must be where that link puts it (ValueError if not)."""
    dirs = package_dirs(repo)
    if not dirs:
        raise ValueError(f"{repo}: pyproject.toml maps no kvgate.* package")
    for name, folder in dirs.items():
        parent, _, leaf = name.rpartition(".")
        if parent == "kvgate":
            link = root / "kvgate" / leaf
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(folder.resolve(), target_is_directory=True)
        elif dirs.get(parent, root) / leaf != folder:
            raise ValueError(f"{repo}: {name} is not under {parent}'s folder; a link tree cannot place it")
    return root
