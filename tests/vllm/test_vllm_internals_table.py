"""``vllm_internals.TOUCHED`` covers what the plugin code references in vLLM, so the
compatibility check and the code cannot drift apart (read with ``ast``; no vLLM needed).

Two rules, as far as a static read can tell:
- every ``from vllm... import X`` in the plugin has an entry for X in that module;
- every attribute the vLLM-touching modules read (``a.b``, ``getattr(a, "b")``) is named by
  an entry, unless the plugin defines that name itself or it is in ``NOT_VLLM``, the
  standard-library and third-party names the plugin uses (each with its owner).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvgate.vllm_plugin.vllm_internals import TOUCHED, Assigned, Internal, Text

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "kvgate_vllm"
# The modules that run inside vLLM and read its objects.
TOUCHING = (
    "engine_plugin.py",
    "engine_probes.py",
    "endpoint_plugin.py",
    "rendering.py",
    "engine_rates.py",
    "pin_keeper.py",
    "retention_connector.py",
    "cpu_tier.py",
)
NOT_VLLM = {
    "__name__": "Python",
    "get": "dict.get, APIRouter.get",
    "encode": "str",
    "join": "str",
    "strip": "str",
    "environ": "os",
    "getLogger": "logging",
    "debug": "logging",
    "info": "logging",
    "warning": "logging",
    "monotonic": "time",
    "perf_counter": "time",
    "wait_for": "asyncio",
    "collect": "prometheus_client registry",
    "samples": "prometheus_client Metric.samples",
    "value": "Enum.value (the scheduling policy), prometheus_client Sample.value",
    "values": "dict.values",
    "headers": "starlette Request.headers",
    "model_validate": "pydantic",
    "type": "pydantic discriminators (thinking.type)",
    "app": "starlette Request.app",
    "post": "fastapi APIRouter.post",
    "include_router": "fastapi",
    "fromkeys": "dict.fromkeys",
}


def _tree(name: str) -> ast.Module:
    return ast.parse((PLUGIN / name).read_text())


def _vllm_imports() -> set[tuple[str, str]]:
    found = set()
    for path in PLUGIN.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                found |= {(node.module, alias.name) for alias in node.names}
    return found


def _attributes_read(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                names.add(node.args[1].value)
    return names


def _names_defined(tree: ast.Module) -> set[str]:
    """Functions, classes, imported names, module- and class-level names and ``self.x``
    attributes (not local variables: a local named like a vLLM attribute defines nothing)."""
    names = set()
    bodies = [tree.body] + [node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for statement in (statement for body in bodies for statement in body):
        targets = _targets(statement)
        names |= {target.id for target in targets if isinstance(target, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def _targets(node: ast.AST) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []


def _own_names() -> set[str]:
    """Names the plugin and the wire contract define (the plugin's own objects)."""
    paths = [*PLUGIN.glob("*.py"), *(REPO / "wire").rglob("*.py")]
    return set().union(*(_names_defined(ast.parse(path.read_text())) for path in paths))


def _entry_names(table: tuple[Internal, ...]) -> set[str]:
    return {entry.name.rpartition(".")[2] for entry in table if not isinstance(entry, Text)}


def uncovered(table: tuple[Internal, ...]) -> set[str]:
    """Attributes the plugin reads on vLLM objects that no entry of ``table`` names."""
    read = set().union(*(_attributes_read(_tree(name)) for name in TOUCHING))
    return read - _own_names() - set(NOT_VLLM) - _entry_names(table)


@pytest.mark.parametrize("module, name", sorted(_vllm_imports()))
def test_every_vllm_import_of_the_plugin_is_in_the_table(module, name):
    assert any(entry.module == module and entry.name.split(".")[0] == name for entry in TOUCHED), (
        f"kvgate_vllm imports {name} from {module}: add it to vllm_internals.TOUCHED"
    )


def test_the_plugin_imports_from_vllm_at_all():
    assert ("vllm.v1.request", "Request") in _vllm_imports()  # the walk above sees the imports


def test_every_vllm_attribute_the_plugin_reads_is_in_the_table():
    assert uncovered(TOUCHED) == set(), "add these to vllm_internals.TOUCHED (or to NOT_VLLM if they are not vLLM's)"


def test_an_entry_dropped_from_the_table_is_noticed():
    for dropped in ("get_request_counts", "scheduler", "openai_serving_chat", "_check_model", "get_vocab"):
        table = tuple(entry for entry in TOUCHED if entry.name.rpartition(".")[2] != dropped)
        assert dropped in uncovered(table), dropped


def test_state_attributes_the_plugin_reads_are_checked_as_assignments():
    assigned = {entry.name.partition(".")[2] for entry in TOUCHED if isinstance(entry, Assigned)}
    state_reads = {
        node.args[1].value
        for node in ast.walk(_tree("rendering.py"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
        if isinstance(node.args[0], ast.Name) and node.args[0].id == "state"
    }
    assert state_reads and state_reads <= assigned
