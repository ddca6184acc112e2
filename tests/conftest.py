"""Shared test configuration. Part-specific fixtures live in each tests/<part>/conftest.py.

The suite runs on several pytest-xdist workers (pyproject.toml's addopts: `-n`,
`--dist loadgroup`). Tests that share an expensive session fixture run on one worker,
as one group: the real-vLLM tests that use the session's shared servers (each starts once
per worker: tests/vllm_plugin/conftest.py), the end-to-end test's prefill server
(a group of its own, so that its run goes on beside the shared servers' chain instead of
lengthening it), the tests that read the check scripts' shared run, the observability
tests (their fixture may install Prometheus with apt, which one process at a time can
do), and the browser tests (one Chromium per module, which may be installed with apt the
same way). Other vLLM tests (a server or a script of their own, no shared fixture) are a
group per module (its module fixture runs once) and go to whichever worker is free. The
vLLM tests are put first, the longest chains first, so that workers start on them at
once (addopts' `--no-loadscope-reorder` keeps this order; xdist would otherwise put the
biggest groups first, the end-to-end test after them).
"""

from __future__ import annotations

import gc

import pytest

GROUPED_FOLDERS = {"observability": "observability", "browser": "browser"}
# session fixture shared by vLLM tests (a server, or the check scripts' run) -> the group of the tests that use it
SHARED_FIXTURES = {
    "vllm_server": "vllm",
    "keyed_server": "vllm",
    "vllm_prefill_server": "vllm_prefill",
    "vllm_checks": "vllm_checks",
}
FIRST = ("vllm", "vllm_prefill")  # the longest chains of tests one worker must take in turn


def _group(item: pytest.Item) -> str | None:
    if item.get_closest_marker("vllm") is not None:
        shared = [SHARED_FIXTURES[name] for name in getattr(item, "fixturenames", ()) if name in SHARED_FIXTURES]
        return shared[0] if shared else "vllm-" + item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    parts = item.nodeid.split("/")
    return GROUPED_FOLDERS.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None


def _rank(item: pytest.Item) -> int:
    group = _group(item)
    if group in FIRST:
        return FIRST.index(group)
    return len(FIRST) if item.get_closest_marker("vllm") is not None else len(FIRST) + 1


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=_rank)  # stable: the rest keep their order


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # The collected tests, their modules and what those imported live as long as the run:
    # out of the collector's way, each of its full passes walks only what the tests make
    # (about 2 s less CPU in the fast tier).
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    # Python's collection at exit would walk everything a worker's 1,400 tests left
    # behind (over a second, which the controller waits for); nothing of it is garbage
    # that needs finding at exit.
    gc.freeze()
