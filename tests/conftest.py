"""Shared test configuration. Part-specific fixtures live in each tests/<part>/conftest.py.

The suite runs on several pytest-xdist workers (pyproject.toml's addopts: `-n`,
`--dist loadgroup`). Tests that share an expensive session fixture run on one worker,
as one group: the real-vLLM tests (their servers start once per worker) and the
observability tests (their fixture may install Prometheus with apt, which one process at
a time can do), and the browser tests (one Chromium per module, which may be installed
with apt the same way). The vLLM group is put first, so that its worker starts on it at once:
it is the longest run of tests one worker must take in turn.

The cluster crosscheck (tests/bench/test_cluster_crosscheck.py) compares virtual time
with two wall-clock benchmark runs of about 25 s that mostly sleep. They start in the
background with the first test of the crosscheck's group (tests/bench/crosscheck_runs.py),
and the group also takes the tests of CROSSCHECK_COMPANIONS (the observability tests
included: the group keeps them on one worker), which run on that worker meanwhile; the
crosscheck's own tests come last in the group and wait for what is left.
"""

from __future__ import annotations

import sys

import pytest

GROUPED_FOLDERS = {"vllm_plugin": "vllm", "observability": "observability", "browser": "browser"}
CROSSCHECK = "cluster_crosscheck"
CROSSCHECK_FILE = "tests/bench/test_cluster_crosscheck.py"
# Folders whose tests mostly wait too (on Prometheus, timeouts, loopback servers: about 20 s
# on one worker, a fifth of a core): they keep the crosscheck's worker busy while its
# benchmarks sleep and add little load to the machine the benchmarks are timed on.
CROSSCHECK_COMPANIONS = ("observability", "security", "balancer", "wire")


def _folder(item: pytest.Item) -> str | None:
    parts = item.nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else None


def _group(item: pytest.Item, crosscheck_selected: bool) -> str | None:
    if item.get_closest_marker("vllm") is not None:
        return "vllm"
    if item.nodeid.startswith(CROSSCHECK_FILE + "::"):
        return CROSSCHECK
    if crosscheck_selected and _folder(item) in CROSSCHECK_COMPANIONS:
        return CROSSCHECK
    return GROUPED_FOLDERS.get(_folder(item) or "")


def _order(item: pytest.Item, group: str | None) -> int:
    """vLLM first; then the crosscheck's group, its own tests last in it; then the rest."""
    if group == "vllm":
        return 0
    if group == CROSSCHECK:
        return 2 if item.nodeid.startswith(CROSSCHECK_FILE + "::") else 1
    return 3


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    crosscheck_selected = any(item.nodeid.startswith(CROSSCHECK_FILE + "::") for item in items)
    groups = {}
    for item in items:
        groups[item.nodeid] = group = _group(item, crosscheck_selected)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: _order(item, groups[item.nodeid]))  # stable: the rest keep their order


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The crosscheck's group's first test starts its wall-clock runs (idempotent)."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None and marker.args and marker.args[0] == CROSSCHECK:
        from tests.bench.crosscheck_runs import RUNS

        RUNS.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Whatever the crosscheck started stops, also when its tests never ran (-x, a crash)."""
    runs = sys.modules.get("tests.bench.crosscheck_runs")
    if runs is not None:
        runs.RUNS.stop()
