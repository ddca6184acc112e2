"""The plugin names the vLLM releases it supports, and says so in vLLM's log when loaded
into another (no vLLM needed: these run everywhere)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvgate.vllm_plugin import engine_plugin, support


@pytest.mark.parametrize(
    "version, supported",
    [
        ("0.32.0", True),
        ("0.33.1", True),
        ("0.33.0+cpu", True),
        ("v0.32.0", True),
        ("0.34.0", True),
        ("0.34.2+cpu", True),
        ("0.35.0", False),
        ("0.31.2", False),
        ("1.0.0", False),
        ("0.4.0", False),
        ("garbage", False),
        (None, False),
    ],
)
def test_supported_releases(version, supported):
    assert (support.unsupported_reason(version) is None) is supported


def test_pyproject_vllm_extra_names_the_same_releases():
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm" + support.SUPPORTED_TEXT]


def test_the_compatibility_check_reads_one_release_of_each_supported_minor():
    """The current release and the two before it, each with a wheel the check reads."""
    minors = sorted(support.release(version) for version in support.CHECKED_RELEASES)
    low, high = support.SUPPORTED_VLLM
    assert minors[0] == low and (minors[-1][0], minors[-1][1] + 1) == high
    assert minors == [(low[0], minor) for minor in range(low[1], high[1])]
    assert all(support.unsupported_reason(version) is None for version in support.CHECKED_RELEASES)


@pytest.fixture
def fake_vllm(monkeypatch):
    """Just enough of a vLLM install for `register`: the module it patches and a version."""
    core = types.ModuleType("vllm.v1.engine.core")

    class EngineCore:
        def step(self):
            return None

    core.EngineCore = EngineCore  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.engine"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", core)
    monkeypatch.setattr(engine_plugin, "_version_checked", False)
    return EngineCore


def test_register_on_an_unsupported_vllm_says_so_in_the_log(fake_vllm, monkeypatch, caplog):
    monkeypatch.setattr(engine_plugin, "installed_vllm_version", lambda: "0.40.1")
    with caplog.at_level(logging.ERROR, logger=engine_plugin.logger.name):
        engine_plugin.register()
        engine_plugin.register()  # once per process
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "vLLM 0.40.1 is not supported" in errors[0] and support.SUPPORTED_TEXT in errors[0]
    assert "docker/vllm.Dockerfile" in errors[0]
    assert hasattr(fake_vllm, engine_plugin.KV_ANSWER_METHOD)  # still installed: the probes report their own errors


def test_register_on_a_supported_vllm_logs_no_error(fake_vllm, monkeypatch, caplog):
    monkeypatch.setattr(engine_plugin, "installed_vllm_version", lambda: "0.32.0")
    with caplog.at_level(logging.INFO, logger=engine_plugin.logger.name):
        engine_plugin.register()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
