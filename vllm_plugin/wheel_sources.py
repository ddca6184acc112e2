"""Python sources of a released vLLM wheel, read without installing or running vLLM.

A vLLM wheel is 240-340 MB (its compiled kernels); the compatibility check
(`compat_check`) needs a few dozen of its ``.py`` files. So ``WheelSources`` reads
those members straight out of the remote zip with HTTP range requests: the zip's
central directory (the end of the file), then each wanted member, a few hundred KB
per release in all. The wheel's address comes from pip itself (``pip install
--dry-run --no-deps --only-binary :all: --report``), so pip's index configuration
applies; nothing is installed and no vLLM code runs.

Every member read is cached under ``${KVGATE_CACHE_DIR:-~/.cache/kvgate}/vllm-wheels/
vllm-<version>/`` (as ``tests/vllm_plugin/vllm_harness.py`` caches the vLLM venv), with the
wheel's name list, so a second run reads no network at all. A released wheel never
changes, so the cache never goes stale; a member is written whole (temp file, rename).
zipfile checks each member's CRC32; the wheel's own sha256 is not checked (that needs
the whole file): the address and the bytes come over TLS from the index pip names.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

CACHE_ROOT = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate")) / "vllm-wheels"
READ_AHEAD = 256 * 1024  # bytes fetched per range request at least (zipfile reads in small pieces)
HTTP_TIMEOUT_SEC = 60.0


class WheelUnavailable(RuntimeError):
    """The release's wheel could not be found or read (network, index, version)."""


def wheel_url(version: str) -> str:
    """The address of the ``vllm==version`` wheel pip would install here (pip's own resolution)."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps"]
    cmd += ["--only-binary", ":all:", "--quiet", "--report", "-", f"vllm=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise WheelUnavailable(
            f"pip found no wheel for vllm=={version} (is the release on the index, and the index "
            f"reachable?): {result.stderr.strip()[-1500:]}"
        )
    report = json.loads(result.stdout)
    urls = [item["download_info"]["url"] for item in report.get("install", [])]
    if len(urls) != 1 or not urls[0].endswith(".whl"):
        raise WheelUnavailable(f"pip resolved vllm=={version} to {urls}, not one wheel")
    return urls[0]


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over an HTTP(S) URL, read with Range requests."""

    def __init__(self, url: str, size: int | None = None):
        super().__init__()
        self.url = url
        self.size = size if size is not None else self._content_length()
        self.pos = 0
        self._buffer_start = 0
        self._buffer = b""
        self.requests = 0  # range requests made (tests and the report read it)

    def _content_length(self) -> int:
        request = urllib.request.Request(self.url, method="HEAD")
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_SEC) as response:
            return int(response.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _fetch(self, start: int, end: int) -> bytes:
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        self.requests += 1
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_SEC) as response:
            if response.status != 206:
                raise WheelUnavailable(f"{self.url} does not serve byte ranges (HTTP {response.status})")
            return response.read()

    def read(self, size: int = -1) -> bytes:
        end = self.size if size is None or size < 0 else min(self.size, self.pos + size)
        if self.pos >= end:
            return b""
        buffer_end = self._buffer_start + len(self._buffer)
        if not (self._buffer_start <= self.pos and end <= buffer_end):
            self._buffer_start = self.pos
            self._buffer = self._fetch(self.pos, min(self.size, max(end, self.pos + READ_AHEAD)))
        data = self._buffer[self.pos - self._buffer_start : end - self._buffer_start]
        self.pos += len(data)
        return data

    def readinto(self, target) -> int:
        data = self.read(len(target))
        target[: len(data)] = data
        return len(data)


class WheelSources:
    """The ``.py`` files of one vLLM release's wheel, by module name, cached on disk.

    ``read("vllm.v1.request")`` is the text of ``vllm/v1/request.py`` (or of the
    package's ``__init__.py``), None when the wheel has no such module."""

    def __init__(self, version: str, cache_root: Path | None = None, resolve: Callable[[str], str] = wheel_url):
        self.version = version
        self.folder = (cache_root or CACHE_ROOT) / f"vllm-{version}"
        self.resolve = resolve  # version -> the wheel's URL (pip's resolution; tests serve their own)
        self._zip: zipfile.ZipFile | None = None
        self._names: set[str] | None = None

    def _open_zip(self) -> zipfile.ZipFile:
        if self._zip is None:
            try:
                self._zip = zipfile.ZipFile(RangeFile(self.resolve(self.version)))
            except (OSError, zipfile.BadZipFile) as exc:
                raise WheelUnavailable(f"cannot read the vllm=={self.version} wheel: {exc}") from exc
        return self._zip

    def names(self) -> set[str]:
        """Every ``.py`` member of the wheel (cached in ``names.json``)."""
        if self._names is None:
            listing = self.folder / "names.json"
            if listing.exists():
                self._names = set(json.loads(listing.read_text()))
            else:
                self._names = {name for name in self._open_zip().namelist() if name.endswith(".py")}
                _write_whole(listing, json.dumps(sorted(self._names)).encode())
        return self._names

    def path_of(self, module: str) -> str | None:
        """The wheel member that defines ``module``, None if there is none."""
        stem = module.replace(".", "/")
        for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
            if candidate in self.names():
                return candidate
        return None

    def read(self, module: str) -> str | None:
        member = self.path_of(module)
        if member is None:
            return None
        cached = self.folder / "src" / member
        if not cached.exists():
            _write_whole(cached, self._open_zip().read(member))
        return cached.read_text(encoding="utf-8")


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    temporary.replace(path)
