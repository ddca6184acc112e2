"""Finding (or installing) Prometheus and promtool for the observability tests.

Order: `$KVGATE_PROMETHEUS` / `$KVGATE_PROMTOOL`, then PATH; where they are missing and
the tests run as root on a Debian-like system, `apt-get install prometheus` (Debian's
package ships both; .ci/run installs it up front). Anywhere else the tests skip, saying
what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

INSTALL_TIMEOUT_S = 600


@dataclass(frozen=True)
class PrometheusTools:
    prometheus: str
    promtool: str


def _find() -> PrometheusTools | None:
    prometheus = os.environ.get("KVGATE_PROMETHEUS") or shutil.which("prometheus")
    promtool = os.environ.get("KVGATE_PROMTOOL") or shutil.which("promtool")
    return PrometheusTools(prometheus, promtool) if prometheus and promtool else None


def _install() -> str:
    """Try Debian's package; '' on success, else why it could not."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "prometheus"]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{' '.join(command)} failed: {err}"
        if done.returncode != 0:
            return f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-300:]}"
    return ""


@pytest.fixture(scope="session")
def prometheus_tools() -> PrometheusTools:
    tools = _find()
    if tools is None:
        why = _install()
        tools = _find()
        if tools is None:
            pytest.skip(
                "Prometheus and promtool are not installed and could not be installed "
                f"({why or 'the package has no such binaries'}); install Debian's `prometheus` "
                "package, or set KVGATE_PROMETHEUS and KVGATE_PROMTOOL to the binaries"
            )
    return tools
