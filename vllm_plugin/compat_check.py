"""Check, statically, that a vLLM release has every internal the plugin touches.

``problems(release, sources)`` walks ``vllm_internals.TOUCHED`` and reads the
release's Python sources with ``ast`` (never importing them): each module, class,
method, attribute and call shape the plugin relies on must be there. Each problem
names the release and the symbol, and which plugin code needs it. Pure: ``sources``
is anything with ``read(module) -> str | None``; ``wheel_sources.WheelSources`` reads
a released wheel.

``python -m kvgate.vllm_plugin.compat_check [VERSION ...]`` checks the given releases
(default: ``support.CHECKED_RELEASES``), printing what it found; exit 1 on any problem.
CI runs it through ``tests/vllm_plugin/test_vllm_compat.py``.

Limits (what a static read cannot see): a member created with ``setattr`` or by a
decorator, or a change in what a method *does*; the live vLLM tests cover behaviour.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvgate.vllm_plugin.vllm_internals import TOUCHED, Assigned, Call, Internal, Member, Symbol, Text, applies

MAX_BASE_DEPTH = 8  # base classes followed at most this deep (vLLM's serving classes go 4 deep)


class Sources(Protocol):
    def read(self, module: str) -> str | None: ...


@dataclass(frozen=True)
class Found:
    """A class or function definition, and the module it is in."""

    module: str
    node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class ClassFound:
    """A class definition, and the module it is in."""

    module: str
    node: ast.ClassDef


class Tree:
    """Parsed modules of one release, each parsed once."""

    def __init__(self, sources: Sources):
        self.sources = sources
        self._parsed: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._parsed:
            text = self.sources.read(name)
            self._parsed[name] = ast.parse(text) if text is not None else None
        return self._parsed[name]

    def definition(self, module: str, name: str, depth: int = 0) -> Found | None:
        """The top-level class or function ``name`` of ``module``, following re-exports
        (``from vllm.x import name`` in ``module``)."""
        tree = self.module(module)
        if tree is None or depth > MAX_BASE_DEPTH:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return Found(module, node)
        source = _imported_from(tree, name)
        return self.definition(source, name, depth + 1) if source else None

    def class_chain(self, found: Found) -> Iterator[ClassFound]:
        """The class and its bases defined in vLLM, nearest first (each once)."""
        seen: set[tuple[str, str]] = set()
        queue = [(found, 0)]
        while queue:
            current, depth = queue.pop(0)
            key = (current.module, current.node.name)
            if key in seen or not isinstance(current.node, ast.ClassDef):
                continue
            seen.add(key)
            yield ClassFound(current.module, current.node)
            for base in current.node.bases:
                base_name = _base_name(base)
                base_found = self.definition(current.module, base_name) if base_name else None
                if base_found is not None and depth < MAX_BASE_DEPTH:
                    queue.append((base_found, depth + 1))


def _imported_from(tree: ast.Module, name: str) -> str | None:
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
            if any((alias.asname or alias.name) == name and alias.name == name for alias in node.names):
                return node.module
    return None


def _base_name(base: ast.expr) -> str | None:
    """``Base`` of ``Base``, ``Base[T]`` or ``module.Base``."""
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else None


def _member(cls: ast.ClassDef, name: str) -> ast.AST | None:
    """``name`` as defined by this class's own body: a method, a class-level (annotated)
    assignment, or ``self.name = ...`` in any of its methods."""
    for statement in cls.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef) and statement.name == name:
            return statement
        if any(isinstance(target, ast.Name) and target.id == name for target in _targets(statement)):
            return statement
    for node in ast.walk(cls):
        if any(_is_attribute(target, "self", name) for target in _targets(node)):
            return node
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment (plain or annotated) assigns to; nothing for other nodes."""
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, ast.AnnAssign) else []


def _is_attribute(target: ast.expr, owner: str, attribute: str) -> bool:
    """Whether ``target`` is ``owner.attribute``."""
    return isinstance(target, ast.Attribute) and target.attr == attribute and _is_name(target.value, owner)


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _fields(chain: list[ClassFound]) -> set[str]:
    """Annotated class-level names over a class chain (dataclass, msgspec and pydantic fields)."""
    return {
        node.target.id
        for found in chain
        for node in found.node.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def call_problem(
    function: ast.FunctionDef | ast.AsyncFunctionDef, positional: int, keywords: tuple[str, ...], bound: bool
) -> str | None:
    """Why ``function`` cannot take ``positional`` positional arguments and ``keywords``
    (``bound``: a method called on an instance, so its first parameter is filled); None if it can."""
    args = function.args
    params = [arg.arg for arg in args.posonlyargs + args.args]
    defaults = len(args.defaults)
    is_static = any(_is_name(decorator, "staticmethod") for decorator in function.decorator_list)
    first_required = len(params) - defaults
    if bound and not is_static:
        params, first_required = params[1:], first_required - 1
    if positional > len(params) and args.vararg is None:
        return f"takes at most {len(params)} positional arguments, the plugin passes {positional}"
    named = set(params[positional:]) | {arg.arg for arg in args.kwonlyargs}
    unknown = [keyword for keyword in keywords if keyword not in named]
    if unknown and args.kwarg is None:
        return f"has no parameter {', '.join(unknown)}"
    missing = [name for name in params[positional:first_required] if name not in keywords]
    missing += [
        arg.arg
        for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
        if default is None and arg.arg not in keywords
    ]
    if missing:
        return f"requires {', '.join(missing)}, which the plugin does not pass"
    return None


def returns_problem(function: ast.FunctionDef | ast.AsyncFunctionDef, count: int) -> str | None:
    """Why ``function``'s annotated ``tuple[...]`` return does not have ``count`` items; None if it
    does, or if the annotation says nothing about it."""
    annotation = function.returns
    if not (isinstance(annotation, ast.Subscript) and _is_name(annotation.value, "tuple")):
        return None
    items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    if any(isinstance(item, ast.Constant) and item.value is Ellipsis for item in items):
        return None
    if len(items) != count:
        return f"returns a tuple of {len(items)} items, the plugin unpacks {count}"
    return None


def _check_member(tree: Tree, module: str, dotted: str) -> tuple[str | None, ast.AST | None]:
    """(problem, node) for ``Class.member`` in ``module``; node is the definition found."""
    class_name, _, member = dotted.partition(".")
    found = tree.definition(module, class_name)
    if found is None or not isinstance(found.node, ast.ClassDef):
        return f"class {class_name} is gone from {module}", None
    chain = list(tree.class_chain(found))
    for link in chain:
        node = _member(link.node, member)
        if node is not None:
            return None, node
    return f"{class_name} has no attribute or method {member}", None


def _check_call(tree: Tree, entry: Call) -> str | None:
    if "." in entry.name:
        problem, node = _check_member(tree, entry.module, entry.name)
        if problem is not None:
            return problem
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return f"{entry.name} is no longer a method"
        function, bound = node, True
    else:
        found = tree.definition(entry.module, entry.name)
        if found is None:
            return f"{entry.name} is gone from {entry.module}"
        if isinstance(found.node, ast.ClassDef):
            return _constructor_problem(tree, found, entry)
        function, bound = found.node, False
    problem = call_problem(function, entry.positional, entry.keywords, bound)
    if problem is None and entry.returns is not None:
        problem = returns_problem(function, entry.returns)
    return problem


def _constructor_problem(tree: Tree, found: Found, entry: Call) -> str | None:
    """A class call: its nearest ``__init__`` in vLLM, else its declared fields."""
    chain = list(tree.class_chain(found))
    for link in chain:
        init = _member(link.node, "__init__")
        if isinstance(init, ast.FunctionDef):
            return call_problem(init, entry.positional, entry.keywords, bound=True)
    unknown = [keyword for keyword in entry.keywords if keyword not in _fields(chain)]
    return f"has no field {', '.join(unknown)}" if unknown else None


def _check_assigned(tree: ast.Module, dotted: str) -> str | None:
    owner, _, attribute = dotted.partition(".")
    for node in ast.walk(tree):
        if any(_is_attribute(target, owner, attribute) for target in _targets(node)):
            return None
    return f"no longer assigns {dotted}"


def _check_text(tree: ast.Module, text: str) -> str | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and text in node.value:
            return None
    return f"no longer contains the string {text!r}"


def entry_problem(tree: Tree, entry: Internal) -> str | None:
    """Why this release lacks ``entry``; None when it has it."""
    module = tree.module(entry.module)
    if module is None:
        return f"module {entry.module} is gone"
    if isinstance(entry, Symbol):
        return None if tree.definition(entry.module, entry.name) else f"{entry.name} is gone from {entry.module}"
    if isinstance(entry, Member):
        return _check_member(tree, entry.module, entry.name)[0]
    if isinstance(entry, Call):
        return _check_call(tree, entry)
    if isinstance(entry, Assigned):
        return _check_assigned(module, entry.name)
    if isinstance(entry, Text):
        return _check_text(module, entry.name)
    raise TypeError(f"unknown table entry {entry!r}")


def release_of(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def problems(version: str, sources: Sources, table: tuple[Internal, ...] = TOUCHED) -> list[str]:
    """Every table entry vLLM ``version`` lacks, each naming the release and the symbol."""
    tree = Tree(sources)
    found = []
    for entry in table:
        if not applies(entry, release_of(version)):
            continue
        problem = entry_problem(tree, entry)
        if problem is not None:
            found.append(
                f"vLLM {version}: {entry.module}.{entry.name}: {problem} (needed by vllm_plugin/{entry.used_by})"
            )
    return found


def main(argv: list[str]) -> int:
    from kvgate.vllm_plugin.support import CHECKED_RELEASES
    from kvgate.vllm_plugin.wheel_sources import WheelSources

    versions = argv or list(CHECKED_RELEASES)
    failed = False
    for version in versions:
        found = problems(version, WheelSources(version))
        for problem in found:
            print(problem, file=sys.stderr)
        checked = sum(applies(entry, release_of(version)) for entry in TOUCHED)
        print(f"vLLM {version}: {checked - len(found)}/{checked} internals the plugin touches are there")
        failed = failed or bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
