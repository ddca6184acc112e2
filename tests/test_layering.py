"""The core parts never depend on the front door (issue 12): no module under gate/,
balancer/, simulator/ or kvgate_vllm/ imports `kvgate.proxy`, at module level or
inside a function. Each part owns its settings and metric families; the proxy
composes them (docs/ARCHITECTURE.md, Packages)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE = ("gate", "balancer", "simulator", "kvgate_vllm")
FRONT_DOOR = "kvgate.proxy"


def front_door_imports(source: str) -> list[str]:
    """`line: statement` for each import of the front door in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == FRONT_DOOR or name.startswith(FRONT_DOOR + ".") for name in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def core_modules() -> list[Path]:
    return sorted(path for part in CORE for path in (REPO / part).rglob("*.py"))


@pytest.mark.parametrize(
    "source, flagged",
    [
        ("from kvgate.proxy.settings import GateSettings", True),
        ("import kvgate.proxy.metrics", True),
        ("from kvgate import proxy", True),
        ("def f():\n    from kvgate.proxy import config\n", True),
        ("from kvgate.gate.settings import GateSettings", False),
        ("from kvgate import gate", False),
        ("import kvgate.proxyish", False),
    ],
)
def test_the_check_recognises_front_door_imports(source, flagged):
    assert bool(front_door_imports(source)) is flagged


def test_every_core_part_is_checked():
    modules = core_modules()
    for part in CORE:
        assert any(p.is_relative_to(REPO / part) for p in modules), f"no module found under {part}/"
    assert len(modules) > 40, [str(p) for p in modules]


def test_no_core_module_imports_the_front_door():
    offenders = {
        str(path.relative_to(REPO)): found
        for path in core_modules()
        if (found := front_door_imports(path.read_text(encoding="utf-8")))
    }
    assert not offenders, f"the core imports {FRONT_DOOR}: {offenders}"
