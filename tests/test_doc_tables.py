"""Tables in the docs that restate the code, checked against the code.

- docs/gate.md's decision table names every field of every decision type
  (`gate/policies/vocabulary.py`) and no other: a field added to `Admit` or `Wait`
  without a row fails here.
- docs/gate.md's code map names every module of `gate/` and `gate/policies/`, and every
  file it names exists.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvgate.gate.policies import vocabulary

REPO = Path(__file__).resolve().parents[1]
GATE_DOC = REPO / "docs" / "gate.md"


def table_after(text: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of the Markdown table whose header line is `header`."""
    lines = text.splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of its level."""
    level = heading.split(" ")[0]
    body = text.split(heading + "\n", 1)[1]
    return re.split(rf"^{level} ", body, maxsplit=1, flags=re.M)[0]


def documented_decision_fields() -> dict[str, set[str]]:
    fields: dict[str, set[str]] = {}
    decision = ""
    for row in table_after(GATE_DOC.read_text(), "| decision | field | the shell |"):
        decision = row[0].strip("`") or decision
        # a field cell names fields in backticks; a type in parentheses is not a field
        named = re.findall(r"`(\w+)`", re.sub(r"\(`\w+`\)", "", row[1]))
        fields.setdefault(decision, set()).update(named)
    return fields


def test_the_decision_table_names_every_field_of_every_decision():
    decisions = {
        cls.__name__: {f.name for f in dataclasses.fields(cls)}
        for cls in vars(vocabulary).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == vocabulary.__name__
    }
    assert documented_decision_fields() == decisions


def test_the_decision_table_check_reads_the_table():
    fields = documented_decision_fields()
    assert {"reason", "window", "footprint"} <= fields["Admit"] and "WaitCause" not in fields["Wait"]


def test_the_gate_code_map_names_every_module_and_only_files_that_exist():
    code_map = section(GATE_DOC.read_text(), "## Code map")
    named = set(re.findall(r"`((?:gate|wire)/[\w/]+\.py)`", code_map))
    modules = {
        str(path.relative_to(REPO))
        for folder in ("gate", "gate/policies")
        for path in (REPO / folder).glob("*.py")
        if path.name != "__init__.py"
    }
    assert sorted(modules - named) == [], "modules missing from docs/gate.md's code map"
    assert sorted(path for path in named if not (REPO / path).is_file()) == []


def test_the_plugins_docstring_names_the_entry_points_pyproject_declares():
    import tomllib

    import kvgate.vllm_plugin

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    plugin_groups = {group: names for group, names in declared.items() if group.startswith("vllm.")}
    assert plugin_groups, "pyproject.toml declares no vLLM entry points"
    doc = " ".join((kvgate.vllm_plugin.__doc__ or "").split())
    for group, names in plugin_groups.items():
        for name, target in names.items():
            assert f"{group}: {name} = {target}" in doc
