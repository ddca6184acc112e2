"""The size limit, checked as the layering is: no function in the gate or the proxy is
over MAX_LINES lines (a long function gets split into named steps instead)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 60
SIZED_PARTS = ("gate", "proxy")


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `source` longer than `limit` lines,
    decorators excluded, nested functions counted on their own too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def test_long_functions_measures_each_function_whole():
    long_body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))  # def line + 60 = 61 lines
    source = f"def short():\n    pass\n\nclass C:\n    async def long(self):\n{long_body}\n"
    assert long_functions(source) == [("long", MAX_LINES + 1)]
    assert long_functions(source, limit=MAX_LINES + 1) == []


@pytest.mark.parametrize("part", SIZED_PARTS)
def test_no_function_over_the_limit(part):
    over = [
        f"{path.relative_to(REPO)}: {name} ({lines} lines)"
        for path in sorted((REPO / part).rglob("*.py"))
        for name, lines in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not over, f"functions over {MAX_LINES} lines; split them into named steps:\n" + "\n".join(over)
