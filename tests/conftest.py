"""Shared test configuration. Part-specific fixtures live in each tests/<part>/conftest.py.

The suite runs on three pytest-xdist workers (pyproject.toml's addopts: `-n 3`,
`--dist loadgroup`): the real-vLLM tests take two lanes, a group each, which are put
first so that two workers start on them at once; the third worker runs the rest of the
suite beside them, much of which waits on timers, sockets and subprocesses (three
workers on 2 cores took 3 min 8 s, two 3 min 50 s). One lane is the tests of the
session's shared tiny-model servers (each starts once: tests/vllm_plugin/conftest.py);
the other is every other vLLM test (the end-to-end test's prefill server, tests with a
server or a script of their own, the check scripts' shared run), then the wall-clock
tests (marker `realtime`), which measure timing and so run only once no vLLM test
loads the CPUs. `--no-loadscope-reorder` keeps this order: xdist would otherwise put
the biggest groups first. The observability tests are a group (their fixture may
install Prometheus with apt, which one process at a time can do), and so are the
browser tests (one Chromium per module, which may be installed with apt the same way).
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

# Images often set PYTHONDONTWRITEBYTECODE=1 (this CI's does). The suite starts hundreds of
# Python processes (three workers, kvgate servers, benchmarks); without bytecode caching each
# one compiles kvgate and rewrites the test modules again: about 10 s of the fast tier's
# wall time on 2 cores. The cache goes to the checkout's __pycache__ folders (git ignores
# them); workers and subprocesses inherit the environment from here.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

GROUPED_FOLDERS = {"observability": "observability", "browser": "browser"}
SHARED_LANE = "vllm"  # the tests of the shared tiny-model servers
OWN_LANE = "vllm_own"  # every other vLLM test, then the wall-clock ones
LANES = (SHARED_LANE, OWN_LANE)  # in the order they are put first
SHARED_SERVERS = ("vllm_server", "keyed_server")


def _group(item: pytest.Item) -> str | None:
    if item.get_closest_marker("vllm") is not None:
        shared = any(name in SHARED_SERVERS for name in getattr(item, "fixturenames", ()))
        return SHARED_LANE if shared else OWN_LANE
    if item.get_closest_marker("realtime") is not None:
        return OWN_LANE
    parts = item.nodeid.split("/")
    return GROUPED_FOLDERS.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None


def _order(item: pytest.Item) -> tuple[int, bool]:
    """The lanes first, in turn; in the own lane, the wall-clock tests after the vLLM ones."""
    group = _group(item)
    return (LANES.index(group) if group in LANES else len(LANES), item.get_closest_marker("realtime") is not None)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=_order)  # stable: the rest keep their order


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
