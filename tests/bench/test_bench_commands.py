"""Every benchmark runner under bench/ is reachable from `kvgate bench`.

A runner is a module with an entry point: an `if __name__ == "__main__":` block, a
top-level `main`, `add_command` or `add_parser`. It is reachable when a `kvgate bench`
subcommand runs it (its `func` is defined there), when a reachable runner starts it
as a process (`python -m` of its dotted name), or, for a package's `__main__`, when a
module of its package is reachable.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

from kvgate.bench import cli as bench_cli

BENCH = Path(__file__).resolve().parents[2] / "bench"
ENTRY_FUNCTIONS = {"main", "add_command", "add_parser"}


def module_name(path: Path) -> str:
    parts = path.relative_to(BENCH).with_suffix("").parts
    return ".".join(("kvgate", "bench", *parts))


def is_runner(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in ENTRY_FUNCTIONS:
            return True
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def runners() -> dict[str, str]:
    """Runner module name -> its source."""
    out = {}
    for path in sorted(BENCH.rglob("*.py")):
        source = path.read_text()
        if is_runner(ast.parse(source)):
            out[module_name(path)] = source
    return out


def bench_subcommands() -> dict[str, str]:
    """`kvgate bench` subcommand -> the module of the function it runs."""
    parser = argparse.ArgumentParser(prog="kvgate")
    bench_cli.add_commands(parser.add_subparsers())
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    commands = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {name: sub.get_default("func").__module__ for name, sub in commands.items()}


def reachable(modules: dict[str, str], roots: set[str]) -> set[str]:
    found = set(roots)
    while True:
        more = {
            name
            for name in modules
            if name not in found
            and (
                any(f'"{name}"' in modules.get(source, "") for source in found)
                or (name.endswith(".__main__") and any(f.startswith(name.removesuffix("__main__")) for f in found))
            )
        }
        if not more:
            return found
        found |= more


def test_every_runner_is_reachable_from_kvgate_bench():
    modules = runners()
    commands = bench_subcommands()
    unreachable = set(modules) - reachable(modules, set(commands.values()))
    assert not unreachable, f"runners under bench/ that no `kvgate bench` subcommand reaches: {sorted(unreachable)}"
    assert "kvgate.bench.scale_out_load" in modules and "kvgate.bench.overhead_load" in modules  # the rule sees them


def test_kvgate_bench_help_lists_every_subcommand():
    kvgate = Path(sys.executable).parent / "kvgate"  # this environment's console script
    out = subprocess.run(
        [str(kvgate), "bench", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for name in bench_subcommands():
        assert f"    {name}" in out, name
