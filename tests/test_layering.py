"""The parts' dependency graph, checked on every import of every module (at module level or
inside a function):

    wire                                   the contract between processes: imports nothing of kvgate
    gate, balancer, simulator, vllm_plugin on wire only: the simulator and the plugin never
                                           import the gate, nor the gate them
    proxy                                  the front door, on gate, balancer and wire
    bench                                  on the parts it measures (bench.cluster: the real gate
                                           and balancer over the engine model in virtual time)
    cli                                    the command line: the only part that assembles all of them

Each part owns its settings and metric families; the proxy composes them, and the command
line composes everything (docs/ARCHITECTURE.md, Layering). `wire` also stays on the standard
library alone (the vLLM plugin loads it inside vLLM's environment), and the probe API's paths
are written in `wire` only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from kvgate.bench.checkout import package_dirs

REPO = Path(__file__).resolve().parent.parent

ALLOWED: dict[str, set[str]] = {
    "wire": set(),
    "gate": {"wire"},
    "balancer": {"wire"},
    "simulator": {"wire"},
    "vllm_plugin": {"wire"},
    "proxy": {"wire", "gate", "balancer"},
    "bench": {"wire", "gate", "balancer", "simulator", "proxy"},
    "cli": {"wire", "gate", "balancer", "simulator", "vllm_plugin", "proxy", "bench"},
}


def parts() -> dict[str, Path]:
    """Part name (`gate` for `kvgate.gate`) -> its folder, as pyproject.toml installs them. A
    package nested in a part that is not a part of its own (bench.agentic) belongs to that part."""
    return {
        name.removeprefix("kvgate."): folder
        for name, folder in package_dirs(REPO).items()
        if name.count(".") == 1 or name.removeprefix("kvgate.") in ALLOWED
    }


def part_of(module: str) -> str | None:
    """The part `module` belongs to: the longest part name it starts with."""
    name = module.removeprefix("kvgate.")
    if name == module:
        return None
    found = [part for part in ALLOWED if name == part or name.startswith(part + ".")]
    return max(found, key=len) if found else None


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) for each absolute import in `source`; `from a import b` yields a and a.b."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def imported_parts(source: str) -> set[str]:
    """The kvgate parts `source` imports (`kvgate.gate.x` and `from kvgate import gate` both name `gate`)."""
    return {part for _, module in imported_modules(source) if (part := part_of(module)) is not None}


def modules_of(folder: Path, exclude: tuple[Path, ...] = ()) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if not any(p.is_relative_to(e) for e in exclude))


def part_modules() -> dict[str, list[Path]]:
    """Each part's own modules: its folder's, less those of parts nested in it (none today: a
    nested package that is not in ALLOWED, such as bench.cluster, is its part's)."""
    folders = parts()
    return {
        name: modules_of(folder, tuple(f for other, f in folders.items() if other != name and f.is_relative_to(folder)))
        for name, folder in folders.items()
    }


@pytest.mark.parametrize(
    "source, found",
    [
        ("from kvgate.proxy.settings import Settings", {"proxy"}),
        ("import kvgate.gate.metrics", {"gate"}),
        ("from kvgate import simulator", {"simulator"}),
        ("def f():\n    from kvgate.bench import cli\n", {"bench"}),
        ("from kvgate.wire.probe_api import KV_PATH\nimport kvgate.balancer", {"wire", "balancer"}),
        ("from kvgate.bench.cluster.run import run_policy", {"bench"}),
        ("from kvgate.simulator.virtual_loop import run_virtual", {"simulator"}),
        ("import kvgate.proxyish", set()),
        ("from . import sibling", set()),
    ],
)
def test_the_check_recognises_imports_of_parts(source, found):
    assert imported_parts(source) == found


def test_the_graph_names_every_part_and_has_no_cycle():
    assert set(parts()) == set(ALLOWED), "place every new part in ALLOWED"
    for part, deps in ALLOWED.items():
        assert deps <= set(ALLOWED) and part not in deps, part
    done: set[str] = set()
    while len(done) < len(ALLOWED):  # peel the parts whose dependencies are all peeled
        ready = {part for part, deps in ALLOWED.items() if part not in done and deps <= done}
        assert ready, f"a cycle among {set(ALLOWED) - done}"
        done |= ready
    assert ALLOWED["wire"] == set() and all("wire" in deps for part, deps in ALLOWED.items() if part != "wire")
    # The engine model and the plugin stand beside the gate, never under or over it.
    for side in ("simulator", "vllm_plugin"):
        assert ALLOWED[side] == {"wire"}, side
        assert side not in ALLOWED["gate"], side


def test_every_part_is_checked():
    modules = part_modules()
    for part in ALLOWED:
        assert modules.get(part), f"no module found for {part}"
    assert sum(len(found) for found in modules.values()) > 100


def test_each_part_imports_only_what_the_graph_allows():
    offenders = {}
    for part, modules in part_modules().items():
        for path in modules:
            extra = imported_parts(path.read_text(encoding="utf-8")) - ALLOWED[part] - {part}
            if extra:
                offenders[str(path.relative_to(REPO))] = sorted(extra)
    assert not offenders, f"imports against the layering (tests/test_layering.py, ALLOWED): {offenders}"


def test_wire_imports_the_standard_library_only():
    outside = {}
    for path in part_modules()["wire"]:
        for line, module in imported_modules(path.read_text(encoding="utf-8")):
            top = module.split(".")[0]
            if not (module.startswith("kvgate.wire") or top in sys.stdlib_module_names or top == "__future__"):
                outside.setdefault(str(path.relative_to(REPO)), []).append(f"{line}: {module}")
    assert not outside, outside


PROBE_PATH_PREFIX = "/v1/kvgate/"


def probe_path_literals(source: str) -> list[int]:
    """Lines of string literals (not docstrings) that spell out a probe API path."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and PROBE_PATH_PREFIX in node.value
        and id(node) not in docstrings
    ]


def test_the_check_finds_path_literals_but_not_docstrings():
    assert probe_path_literals('"""GET /v1/kvgate/kv"""\nURL = base + "/v1/kvgate/kv"\n') == [2]
    assert probe_path_literals('def f():\n    """POST /v1/kvgate/prefix"""\n') == []


def test_the_probe_api_paths_are_written_in_wire_only():
    wire = parts()["wire"]
    found = {
        str(path.relative_to(REPO)): lines
        for folder in parts().values()
        for path in modules_of(folder)
        if not path.is_relative_to(wire) and (lines := probe_path_literals(path.read_text(encoding="utf-8")))
    }
    assert not found, f"probe API paths outside kvgate.wire (import KV_PATH, PREFIX_PATH, OWNER_PATH): {found}"
