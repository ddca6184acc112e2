"""Fixtures for the real-vLLM tests: the cached vLLM venv, the two models, their servers.

Each server is started once per test session (startup costs 25-70 s on 2 cores), on
first use, and shared by every test that asks for it; tests stay independent of each
other by using unique prompts or by resetting vLLM's prefix cache first.
``vllm_server`` serves the tiny model (plugin behaviour); ``vllm_prefill_server``
serves the prefill-bound model, where re-prefill costs real time (end-to-end gains);
``keyed_server`` serves the tiny model with keys, the retention connector and priority
scheduling (keyed_server.py). Every test that starts a server of a configuration of its
own pays a server start (22-26 s on 2 cores; these shared ones, with the model in the
engine core's process, 16 s): prefer one of these.

Each server computes on one OpenMP thread (`vllm_harness.TEST_LAYOUT_ENV`): two pytest workers run two
servers and other tests at once on 2 cores, and a server's second thread, spinning for
a core the other server holds, made each engine step many times slower (the vLLM tests
took 4 min 48 s with vLLM's default of a thread per core, 2 min 51 s with one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from keyed_server import REPLICA_KEY, VLLM_KEY
from vllm_harness import (
    TEST_LAYOUT_ARGS,
    TEST_LAYOUT_ENV,
    VllmServer,
    ensure_prefill_model,
    ensure_tiny_model,
    ensure_vllm_venv,
    run_checks,
)

# The scripts that drive vLLM's real managers without a server (scripts/*_checks.py and
# probe_side_effects.py): they run together, from one import of vLLM (`vllm_checks`).
CHECK_SCRIPTS = ("cpu_tier_checks.py", "cpu_tier_sequence_checks.py", "pin_keeper_checks.py", "probe_side_effects.py")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return ensure_vllm_venv()


@pytest.fixture(scope="session")
def vllm_checks(vllm_python: Path) -> dict[str, dict]:
    """Every check script's run, by script (`check_json` reads one): run once per test
    session, together, through scripts/run_checks.py, which imports torch and vLLM (6 s of
    each script's 7) once and forks a child per script."""
    return run_checks(vllm_python, CHECK_SCRIPTS)


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    return ensure_tiny_model(vllm_python)


def _served(
    python: Path,
    model_dir: Path,
    tmp_path_factory,
    served_model_name: str,
    extra_args: tuple[str, ...] = (),
    extra_env: tuple[tuple[str, str], ...] = (),
    name: str = "",
):
    """One started server for the test session, stopped (with its process group) at its end."""
    log_dir = tmp_path_factory.mktemp(f"vllm-{name or served_model_name}-server")
    server = VllmServer(
        python=python,
        model_dir=model_dir,
        log_path=log_dir / "vllm.log",
        served_model_name=served_model_name,
        extra_args=TEST_LAYOUT_ARGS + extra_args,
        extra_env=TEST_LAYOUT_ENV + extra_env,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(vllm_python: Path, tiny_model: Path, tmp_path_factory) -> VllmServer:
    yield from _served(vllm_python, tiny_model, tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def prefill_model(vllm_python: Path) -> Path:
    return ensure_prefill_model(vllm_python)


@pytest.fixture(scope="session")
def vllm_prefill_server(vllm_python: Path, prefill_model: Path, tmp_path_factory) -> VllmServer:
    """The prefill-bound model on the tiny server's cache shape (64 x 32-token blocks), engine
    steps capped at 512 tokens: an uncapped 2,048-token prefill step lasts seconds on 2 cores,
    longer than the gate's probe timeout (probes are answered between steps)."""
    yield from _served(
        vllm_python, prefill_model, tmp_path_factory, "prefill", extra_args=("--max-num-batched-tokens", "512")
    )


@pytest.fixture(scope="session")
def keyed_server(vllm_python: Path, tiny_model: Path, tmp_path_factory) -> VllmServer:
    """The tiny model (64 blocks of 32 tokens) with vLLM's client key, the replica key read
    from a file, the retention connector, priority scheduling and auto tool choice (keyed_server.py)."""
    from kvgate.vllm_plugin.pin_keeper import CONNECTOR_CONFIG

    key_file = tmp_path_factory.mktemp("vllm-keys") / "replica.key"
    key_file.write_text(REPLICA_KEY + "\n")
    yield from _served(
        vllm_python,
        tiny_model,
        tmp_path_factory,
        "tiny",
        extra_args=(
            "--kv-transfer-config",
            CONNECTOR_CONFIG,
            "--scheduling-policy",
            "priority",
            # a request may leave the tool choice to the model (test_final_reply_on_vllm.py)
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "pythonic",
        ),
        extra_env=(("KVGATE_REPLICA_API_KEY_FILE", str(key_file)), ("VLLM_API_KEY", VLLM_KEY)),
        name="keyed",
    )
