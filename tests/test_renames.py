"""The names CHANGELOG.md retired stay retired: no tracked file but the changelog and the
places that refuse them with the new name (`RENAMED_POLICIES`, `RENAMED_MODES` and their
tests) spells an old name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# old name -> what CHANGELOG.md says to write instead
RETIRED = {
    "reserved_session": "holds_window",
    "RESERVED_SESSION": "HOLDS_WINDOW",
    "contract_fits": "window_fits",
    "CONTRACT_FITS": "WINDOW_FITS",
    "kvgate_reserved_sessions": "kvgate_windows",
    "admission_preempted": "admission_superseded",
    "AdmissionPreempted": "AdmissionSuperseded",
    "kvgate_preempted_attempts": "kvgate_superseded_attempts",
    "kvgate_session_preemptions": "kvgate_session_supersessions",
    "num_preempted": "num_superseded",
    "attempts_preempted_409": "attempts_superseded_409",
    "gate_knobs": "gate_settings",
    "kvgate-contract": "kvgate-working_set",
    "policy: seed": "policy: watermark",
    "policy: contract": "policy: working_set",
    'policy="seed"': 'policy="watermark"',
    'policy="contract"': 'policy="working_set"',
    '"policy": "seed"': '"policy": "watermark"',
    '"policy": "contract"': '"policy": "working_set"',
    "POLICY=seed": "POLICY=watermark",
    "POLICY=contract": "POLICY=working_set",
    "issue-9": "silent-burst",
    "kvgate_pending_sessions": "kvgate_waiters",
    "pending_anonymous": "waiters_anonymous",
    "resident_blocks": "footprint_blocks",
    "kvgate_vllm": "vllm_plugin",
}
# Where an old name must appear: the list of renames, and the refusals that name the new one.
ALLOWED = {
    "CHANGELOG.md",
    "gate/policies/registry.py",
    "bench/agentic/runner.py",
    "bench/agentic/regimes.py",
    "tests/bench/test_agentic_regimes.py",
    "tests/gate/test_policies.py",
    "tests/proxy/test_proxy_config.py",
    "tests/test_renames.py",
}
# An old name inside a longer one counts (shadow_reserved_session), a longer word does not.
PATTERN = re.compile("|".join(rf"(?<![A-Za-z0-9-]){re.escape(old)}(?![\w-])" for old in RETIRED))


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [name for name in out.splitlines() if (REPO / name).is_file()]


def test_the_pattern_finds_an_old_name_and_not_a_new_one():
    assert PATTERN.search("gate: {policy: contract}") and PATTERN.search("x-kvgate-admission: reserved_session")
    assert PATTERN.search("shadow_reserved_session") and PATTERN.search("AdmissionReason.CONTRACT_FITS")
    assert not PATTERN.search("policy: working_set, holds_window, kvgate_windows, num_superseded")
    assert not PATTERN.search("shadow_window_fits kvgate-working_set")


def test_no_retired_name_is_written_anywhere():
    found = []
    for name in tracked_text_files():
        if name in ALLOWED:
            continue
        try:
            text = (REPO / name).read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for match in PATTERN.finditer(line):
                found.append(f"{name}:{number}: {match.group()} (write {RETIRED[match.group()]})")
    assert not found, "\n".join(found)
