"""Installing a Debian package a test tier needs (Prometheus, Chromium), where one can.

The tiers that need a system binary find it first; where it is missing and the tests run
as root on a Debian-like system they install the package with apt-get (.ci/run installs
them up front), and anywhere else they skip, saying what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess

INSTALL_TIMEOUT_S = 600


def apt_install(package: str) -> str:
    """`apt-get install` Debian's `package`; '' on success, else why it could not."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"{' '.join(command)} failed: {err}"
        if done.returncode != 0:
            return f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-300:]}"
    return ""
