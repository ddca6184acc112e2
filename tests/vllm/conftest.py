"""Fixtures for the real-vLLM tests: the cached vLLM venv, the tiny model, one server.

One server is started per test session (startup costs 25-70 s on 2 cores) and
shared by every test in tests/vllm; tests stay independent of each other by using
unique prompts or by resetting vLLM's prefix cache first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_harness import VllmServer, ensure_tiny_model, ensure_vllm_venv


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return ensure_vllm_venv()


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    return ensure_tiny_model(vllm_python)


@pytest.fixture(scope="session")
def vllm_server(vllm_python: Path, tiny_model: Path, tmp_path_factory) -> VllmServer:
    log_dir = tmp_path_factory.mktemp("vllm-server")
    server = VllmServer(python=vllm_python, model_dir=tiny_model, log_path=log_dir / "vllm.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
