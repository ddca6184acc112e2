"""The README's two commands: the one that installs and runs the tests is what `.ci/run` runs.

The README promises that `.ci/run` runs exactly its test command, so a change to either
that is not made to the other fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The command lines of the README's first bash block (comments dropped)."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md: the two commands are its first ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_gives_an_install_and_run_command_and_a_test_command():
    serve, test = readme_commands()
    assert serve.startswith("python3.11 -m venv .venv") and serve.endswith("kvgate serve")
    assert test.startswith("python3.11 -m venv .venv") and "pytest" in test


def test_ci_runs_exactly_the_readme_test_command():
    _, test = readme_commands()
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines, f".ci/run must run the README's test command as is: {test}"


def test_documentation_table_lists_each_document_once():
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Documentation") :]
    targets = re.findall(r"^\| \[[^\]]*\]\(([^)]+)\)", table, re.M)
    assert targets, "README.md: the Documentation section is a table of links"
    repeated = sorted({t for t in targets if targets.count(t) > 1})
    assert not repeated, f"README.md lists these documents twice: {repeated}"
