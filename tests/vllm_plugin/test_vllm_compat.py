"""Each supported vLLM release has every internal the plugin touches (``compat_check``
over the release's wheel), and the wheel reader itself, on a wheel served over loopback.

The release checks read the wheels' sources over the network the first time (a few
hundred KB per release, about 4 s each) and from ``${KVGATE_CACHE_DIR:-~/.cache/kvgate}/
vllm-wheels`` after that; they are marked ``vllm_compat`` (skip with ``-m 'not vllm_compat'``).
"""

from __future__ import annotations

import http.server
import io
import os
import threading
import zipfile

import pytest

from kvgate.vllm_plugin import compat_check, support
from kvgate.vllm_plugin.wheel_sources import WheelSources, WheelUnavailable


@pytest.mark.vllm_compat
@pytest.mark.parametrize("version", support.CHECKED_RELEASES)
def test_every_supported_release_has_what_the_plugin_touches(version):
    assert compat_check.problems(version, WheelSources(version)) == []


class Doctored:
    """A real release's sources with one module's text changed."""

    def __init__(self, sources: WheelSources, module: str, old: str, new: str):
        self.sources, self.module, self.old, self.new = sources, module, old, new

    def read(self, module: str) -> str | None:
        text = self.sources.read(module)
        if module == self.module and text is not None:
            assert self.old in text, f"{self.old!r} is not in {module}: the doctoring changes nothing"
            return text.replace(self.old, self.new)
        return text


@pytest.mark.vllm_compat
@pytest.mark.parametrize(
    "module, old, new, symbol",
    [
        (
            "vllm.v1.core.block_pool",
            "def get_num_free_blocks(",
            "def num_free_blocks(",
            "BlockPool.get_num_free_blocks",
        ),
        (
            "vllm.v1.request",
            "        block_hasher:",
            "        hasher:",
            "vllm.v1.request.Request: has no parameter block_hasher",
        ),
        ("vllm.v1.core.kv_cache_coordinator", "int, int]:", "int]:", "KVCacheCoordinator.find_longest_cache_hit"),
    ],
)
def test_a_doctored_real_release_fails_naming_release_and_symbol(module, old, new, symbol):
    version = support.CHECKED_RELEASES[-1]
    found = compat_check.problems(version, Doctored(WheelSources(version), module, old, new))
    assert found and all(problem.startswith(f"vLLM {version}: ") for problem in found), found
    assert any(symbol in problem for problem in found), found


def _wheel(modules: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for module, text in modules.items():
            wheel.writestr(module.replace(".", "/") + ".py", text)
        wheel.writestr("vllm/_C.abi3.so", os.urandom(2_000_000), zipfile.ZIP_STORED)  # never read
        wheel.writestr("vllm-9.9.0.dist-info/METADATA", "Name: vllm\nVersion: 9.9.0\n")
    return buffer.getvalue()


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.wheel`` with Range requests only (as the package index does)."""

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.server.wheel)))  # type: ignore[attr-defined]
        self.end_headers()

    def do_GET(self):
        wheel = self.server.wheel  # type: ignore[attr-defined]
        start, _, end = self.headers["Range"].removeprefix("bytes=").partition("-")
        body = wheel[int(start) : int(end) + 1]
        self.server.ranges.append((int(start), len(body)))  # type: ignore[attr-defined]
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def served_wheel():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    server.wheel = b""  # type: ignore[attr-defined]
    server.ranges = []  # type: ignore[attr-defined]
    # shutdown() waits for serve_forever's next poll: every 0.5 s by default
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_wheel_reader_reads_members_by_range_and_then_from_its_cache(served_wheel, tmp_path):
    core = "class EngineCore:\n    def step(self):\n        return None\n"
    served_wheel.wheel = _wheel({"vllm.v1.engine.core": core, "vllm.v1.__init__": ""})
    url = f"http://127.0.0.1:{served_wheel.server_address[1]}/vllm-9.9.0-py3-none-any.whl"
    sources = WheelSources("9.9.0", cache_root=tmp_path, resolve=lambda version: url)
    assert sources.read("vllm.v1.engine.core") == core
    assert sources.read("vllm.v1") == "" and sources.read("vllm.v1.nothing") is None
    assert sum(length for _, length in served_wheel.ranges) < len(served_wheel.wheel) // 2  # never the kernels
    served_wheel.ranges.clear()

    def offline(version: str) -> str:
        raise WheelUnavailable("no network")

    cached = WheelSources("9.9.0", cache_root=tmp_path, resolve=offline)
    assert cached.read("vllm.v1.engine.core") == core and served_wheel.ranges == []
    assert (tmp_path / "vllm-9.9.0" / "src" / "vllm" / "v1" / "engine" / "core.py").read_text() == core


def test_a_doctored_wheel_fails_naming_the_release_and_the_symbol(served_wheel, tmp_path):
    served_wheel.wheel = _wheel({"vllm.v1.engine.core": "class EngineCore:\n    pass\n"})
    url = f"http://127.0.0.1:{served_wheel.server_address[1]}/vllm.whl"
    found = compat_check.problems("0.34.0", WheelSources("0.34.0", cache_root=tmp_path, resolve=lambda version: url))
    assert "vLLM 0.34.0: vllm.v1.engine.core.EngineCore.step: EngineCore has no attribute or method step" in "\n".join(
        found
    )
    assert (
        "vLLM 0.34.0: vllm.v1.core.sched.scheduler.Scheduler.schedule: module vllm.v1.core.sched.scheduler is gone"
        in ("\n".join(found))
    )
