"""`kvgate bench agentic` as the end-to-end tests run it: the tiny regime in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path


def run_tiny_regime(out: Path, modes: str, *options: str) -> tuple[dict, str]:
    """Run the tiny regime's `modes` (plus CLI `options`) into `out`; (the results document,
    what the run printed). The run must exit 0."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate.bench.agentic",
            "--regime",
            "tiny",
            "--modes",
            modes,
            *options,
            "--out",
            str(out),
            "--no-plots",
            "--request-timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=900,  # a hang, not a slow machine: the runs take 1-4 minutes under load
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), result.stdout
