"""Shared test configuration. Part-specific fixtures live in each tests/<part>/conftest.py.

The suite runs on several pytest-xdist workers (pyproject.toml's addopts: `-n`,
`--dist loadgroup`). Tests that share an expensive session fixture run on one worker,
as one group: the real-vLLM tests (their servers start once per worker) and the
observability tests (their fixture may install Prometheus with apt, which one process at
a time can do), and the browser tests (one Chromium per module, which may be installed
with apt the same way). The vLLM group is put first, so that its worker starts on it at once:
it is the longest run of tests one worker must take in turn.
"""

from __future__ import annotations

import pytest

GROUPED_FOLDERS = {"vllm_plugin": "vllm", "observability": "observability", "browser": "browser"}


def _group(item: pytest.Item) -> str | None:
    if item.get_closest_marker("vllm") is not None:
        return "vllm"
    parts = item.nodeid.split("/")
    return GROUPED_FOLDERS.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: _group(item) != "vllm")  # stable: the rest keep their order
