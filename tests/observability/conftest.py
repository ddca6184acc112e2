"""Finding (or installing) Prometheus and promtool for the observability tests.

Order: `$KVGATE_PROMETHEUS` / `$KVGATE_PROMTOOL`, then PATH; where they are missing and
the tests run as root on a Debian-like system, `apt-get install prometheus` (Debian's
package ships both; .ci/run installs it up front). Anywhere else the tests skip, saying
what to install.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import pytest

from tests.apt_install import apt_install


@dataclass(frozen=True)
class PrometheusTools:
    prometheus: str
    promtool: str


def _find() -> PrometheusTools | None:
    prometheus = os.environ.get("KVGATE_PROMETHEUS") or shutil.which("prometheus")
    promtool = os.environ.get("KVGATE_PROMTOOL") or shutil.which("promtool")
    return PrometheusTools(prometheus, promtool) if prometheus and promtool else None


@pytest.fixture(scope="session")
def prometheus_tools() -> PrometheusTools:
    tools = _find()
    if tools is None:
        why = apt_install("prometheus")
        tools = _find()
        if tools is None:
            pytest.skip(
                "Prometheus and promtool are not installed and could not be installed "
                f"({why or 'the package has no such binaries'}); install Debian's `prometheus` "
                "package, or set KVGATE_PROMETHEUS and KVGATE_PROMTOOL to the binaries"
            )
    return tools
