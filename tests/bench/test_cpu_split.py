"""The engine/frontend CPU split: planning and checking are pure; pinning is tried on real processes."""

import os
import subprocess
import sys
import time

import pytest

from kvgate.bench.cpu_split import (
    ENGINE,
    FRONTEND,
    CpuSplit,
    PinningError,
    ProcessAffinity,
    descendants,
    format_cpu_list,
    parse_cpu_list,
    pin_server_tree,
    plan_split,
    read_parents,
    thread_affinities,
    violations,
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-1", {0, 1}), ("0-2,5", {0, 1, 2, 5}), ("1,3-4,7", {1, 3, 4, 7}), ("", set())],
)
def test_cpu_lists_read_and_write_the_kernels_format(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(cpus) == text
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_two_cpus_give_the_engine_the_second_and_the_frontend_the_first():
    split = plan_split({0, 1})
    assert split == CpuSplit(engine=frozenset({1}), frontend=frozenset({0}))
    assert split.omp_threads_bind == "1"
    assert split.describe() == "engine CPUs 1, frontend CPUs 0"


def test_the_engine_gets_the_upper_half_of_any_cpu_set():
    assert plan_split(range(8)).engine == {4, 5, 6, 7}
    odd = plan_split({0, 1, 2})  # half rounded down: the frontend keeps the odd one
    assert odd.engine == {2} and odd.frontend == {0, 1}
    sparse = plan_split({3, 9, 5, 12})  # a cpuset that is not 0..n-1
    assert sparse.engine == {9, 12} and sparse.frontend == {3, 5}
    assert plan_split(range(4), engine_cpus=3).omp_threads_bind == "1-3"


@pytest.mark.parametrize("cpus", [range(8), {0, 1}, {2, 7, 9}])
def test_a_split_is_disjoint_covers_its_cpus_and_leaves_neither_side_empty(cpus):
    split = plan_split(cpus)
    assert split.engine and split.frontend
    assert not split.engine & split.frontend
    assert split.engine | split.frontend == set(cpus)


def test_one_cpu_refuses_pinned_mode_and_says_what_to_run_instead():
    with pytest.raises(PinningError) as refused:
        plan_split({0})
    message = str(refused.value)
    assert "at least 2 CPUs" in message and "CPU" in message and "--pinning unpinned" in message
    with pytest.raises(PinningError, match="--pinning unpinned"):
        plan_split(set())


@pytest.mark.parametrize("engine_cpus", [0, 4, -1])
def test_an_engine_share_that_leaves_a_side_empty_is_refused(engine_cpus):
    with pytest.raises(PinningError, match="1 to 3 of the 4 CPUs"):
        plan_split(range(4), engine_cpus=engine_cpus)


def test_descendants_walk_the_whole_tree_below_a_process():
    parents = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert descendants(parents, 10) == [11, 12, 13]
    assert descendants(parents, 20) == [21]
    assert descendants(parents, 12) == []


def test_violations_name_each_thread_outside_its_sides_cpus():
    split = plan_split({0, 1})
    engine = ProcessAffinity(5, "VLLM::Worker", ENGINE, {5: frozenset({1}), 6: frozenset({0, 1})})
    frontend = ProcessAffinity(7, "kvgate serve", FRONTEND, {7: frozenset({0})})
    assert violations([frontend], split) == []
    found = violations([engine, frontend], split)
    assert found == ["engine process 5 (VLLM::Worker) may run outside CPUs 1: threads 6 on 0-1"]
    assert engine.cpus == {0, 1} and engine.as_dict()["threads"] == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 CPUs")
def test_pinning_a_server_tree_moves_every_thread_of_the_root_and_of_each_process_below():
    """A stand-in server: a root with a thread, and a child with a thread (the engine's shape)."""
    child = (
        "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)"
    )
    root_code = (
        "import subprocess, sys, threading, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)"
    )
    root = subprocess.Popen([sys.executable, "-c", root_code])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            below = descendants(read_parents(), root.pid)
            if below and len(thread_affinities(below[0])) >= 2 and len(thread_affinities(root.pid)) >= 2:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the stand-in server did not start its child and threads")
        split = plan_split(os.sched_getaffinity(0))
        moved = pin_server_tree(root.pid, split)
        assert moved[root.pid] >= 2 and moved[below[0]] >= 2
        assert set(thread_affinities(root.pid).values()) == {split.frontend}
        assert set(thread_affinities(below[0]).values()) == {split.engine}
        assert pin_server_tree(root.pid, split) == {root.pid: 0, below[0]: 0}  # nothing left to move
    finally:
        for pid in descendants(read_parents(), root.pid):
            os.kill(pid, 9)
        root.kill()
        root.wait()
