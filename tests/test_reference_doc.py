"""docs/reference.md against the code, in both directions.

Each check reads one kind of fact from the code as the running product exposes it (the
argparse tree of the `kvgate` console script, the settings dataclasses, a live proxy's
metrics registry and routes, the typed probe answers of `kvgate.wire` and a live simulated
replica's answers, the environment variables the code reads) and the same kind from the
page's tables, and asserts the two sets are equal: a fact added to the code and not to
the page fails, and so does one the page still lists after the code dropped it. Config defaults are compared as values.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import subprocess
import typing
from importlib.metadata import entry_points
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reference.md"
CODE = re.compile(r"`([^`]+)`")

# ---------------------------------------------------------------- reading the page


def doc_sections() -> dict[str, str]:
    """Heading text (without #) -> the text under it up to the next heading of any level."""
    out: dict[str, str] = {}
    title, lines = "", []
    for line in DOC.read_text().splitlines():
        match = re.match(r"#{2,4} (.+)", line)
        if match:
            out[title] = "\n".join(lines)
            title, lines = match.group(1).strip(), []
        else:
            lines.append(line)
    out[title] = "\n".join(lines)
    return out


def doc_part(level2_title: str) -> str:
    """The text of a `## ` section with all its subsections."""
    text = DOC.read_text()
    start = text.index(f"\n## {level2_title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of every Markdown table in `text` (header and rule rows dropped)."""
    rows: list[list[str]] = []
    previous_was_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            previous_was_table = False
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not previous_was_table or set("".join(cells)) <= set("-: "):
            previous_was_table = True  # the header row, or the rule under it
            continue
        rows.append(cells)
    return rows


def first_code(cell: str) -> str | None:
    match = CODE.search(cell)
    return match.group(1) if match else None


def codes(cell: str) -> list[str]:
    return CODE.findall(cell)


def assert_same(documented: set, code: set, where: str) -> None:
    """The page lists exactly what the code has; the message names both differences."""
    assert documented == code, (
        f"docs/reference.md, {where}: not documented {sorted(code - documented, key=str)}, "
        f"documented but gone from the code {sorted(documented - code, key=str)}"
    )


# ---------------------------------------------------------------- command line


def kvgate_parser(monkeypatch) -> argparse.ArgumentParser:
    """The parser the `kvgate` console script builds, found through its entry point (wherever
    the CLI module lives): its `parse_args` is intercepted on the first call."""
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "kvgate"]
    main = script.load()
    captured: list[argparse.ArgumentParser] = []

    class Captured(Exception):
        pass

    def capture(self, *args, **kwargs):
        captured.append(self)
        raise Captured

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Captured):
        main([])
    return captured[0]


def leaf_commands(parser: argparse.ArgumentParser, prefix: str = "kvgate") -> dict[str, set[str]]:
    """`kvgate serve` -> its flags (`--config`) and positionals (their metavar), for every command
    without subcommands."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subparsers:
        out: dict[str, set[str]] = {}
        for action in subparsers:
            for name, sub in action.choices.items():
                out.update(leaf_commands(sub, f"{prefix} {name}"))
        return out
    flags: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            flags.add(max(action.option_strings, key=len))
        else:
            flags.add(str(action.metavar or action.dest.upper()))
    return {prefix: flags}


def test_every_command_and_flag_is_documented(monkeypatch):
    code = leaf_commands(kvgate_parser(monkeypatch))
    documented: dict[str, set[str]] = {}
    for title, body in doc_sections().items():
        command = first_code(title)
        if command and command.startswith("kvgate ") and title.startswith("`"):
            documented[command] = {cell[0].strip("`").split()[0] for cell in table_rows(body)}
    assert_same(set(documented), set(code), "Command line (one ### section per command)")
    for command, flags in code.items():
        assert_same(documented[command], flags, f"`{command}`")


# ---------------------------------------------------------------- configuration


def _settings_class():
    from kvgate.proxy.settings import Settings

    return Settings


def config_keys(cls=None, prefix: str = "") -> dict[str, object]:
    """Every config key's dotted path -> its default (lists as lists; `required` when none),
    walked from the settings dataclasses. A list of mappings (`replicas`) is a key itself and
    its items' keys are `replicas[].name`."""
    cls = cls or _settings_class()
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        path, tp = prefix + f.name, hints[f.name]
        if f.default is not dataclasses.MISSING:
            default: object = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "required"
        if dataclasses.is_dataclass(tp):
            out.update(config_keys(tp, path + "."))
            continue
        if isinstance(default, tuple):
            default = list(default)
        out[path] = default
        args = typing.get_args(tp)
        if typing.get_origin(tp) is tuple and args and dataclasses.is_dataclass(args[0]):
            out.update(config_keys(args[0], path + "[]."))
    return out


def documented_config() -> dict[str, str]:
    rows = table_rows(doc_part("Configuration"))
    out: dict[str, str] = {}
    for row in rows:
        key = first_code(row[0])
        if key and not key.startswith("KVGATE_"):
            assert key not in out, f"docs/reference.md documents {key} twice"
            out[key] = row[1]
    return out


def test_every_config_key_is_documented_with_its_default():
    code = config_keys()
    documented = documented_config()
    assert_same(set(documented), set(code), "Configuration")
    for key, default in code.items():
        cell = documented[key]
        shown = "required" if cell == "required" else yaml.safe_load(first_code(cell) or "")
        assert shown == default, f"docs/reference.md: {key} defaults to {default!r} in the code, {cell} on the page"


def _env_reads(tree: ast.AST) -> set[str]:
    """KVGATE_* names read through os.environ.get / os.getenv / os.environ[...]."""
    names: set[str] = set()
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            arg = node.slice
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("KVGATE_"):
            names.add(arg.value)
    return names


def tracked_files(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.splitlines() if (REPO / line).is_file()]


def test_every_environment_variable_is_documented():
    code: set[str] = set()
    for path in tracked_files("*.py"):
        code |= _env_reads(ast.parse(path.read_text(), str(path)))
    for path in tracked_files(".ci/*"):
        code |= set(re.findall(r"\$\{?(KVGATE_[A-Z0-9_]+)", path.read_text()))
    documented = {name for row in table_rows(doc_sections()["Other environment variables"]) for name in codes(row[0])}
    assert_same(documented, code, "Other environment variables")
    from kvgate.proxy.config import OTHER_VARIABLES  # the config loader refuses every other KVGATE_* name

    assert_same(documented, set(OTHER_VARIABLES), "Other environment variables (kvgate.proxy.config.OTHER_VARIABLES)")


# ---------------------------------------------------------------- HTTP


def test_forwarded_routes_are_documented():
    from kvgate.wire.routes import ROUTES

    documented = {
        (first_code(r[0]), first_code(r[1]), first_code(r[2])) for r in table_rows(doc_sections()["Forwarded routes"])
    }
    assert_same(documented, {(r.method, r.path, r.kind) for r in ROUTES}, "Forwarded routes")


def _dispatch_constants(cls) -> set[str]:
    """The path strings and path segments a dispatcher compares a request's path with."""
    import inspect

    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    found: set[str] = set()
    for node in ast.walk(tree):
        values: list[ast.AST] = []
        if isinstance(node, ast.Compare) and "method" not in ast.unparse(node.left):
            for comparator in node.comparators:
                values.extend(comparator.elts if isinstance(comparator, ast.List) else [comparator])
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("path.startswith"):
            values.extend(node.args)
        for value in values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                if re.fullmatch(r"/[a-z/_]*|[a-z_]+", value.value):
                    found.add(value.value)
    return found


def _documented_routes(*titles: str) -> list[tuple[str, str]]:
    sections = doc_sections()
    return [(first_code(r[0]) or "", first_code(r[1]) or "") for t in titles for r in table_rows(sections[t])]


async def test_own_and_admin_routes_are_documented_and_answer():
    from kvgate.proxy.app import create_app
    from kvgate.proxy.settings import AdminSettings

    settings = dataclasses.replace(_settings_class()(), admin=AdminSettings(token="t"))
    app = create_app(settings, replicas=(), health_checks=False)
    documented = _documented_routes("Own routes", "Admin API")
    paths = {path for _, path in documented} | set(codes(doc_part("HTTP: the front door")))
    segments = {segment for path in paths for segment in path.split("/")}
    code = _dispatch_constants(type(app)) | _dispatch_constants(type(app.admin))
    for constant in sorted(code):
        known = any(p.startswith(constant) for p in paths) if constant.startswith("/") else constant in segments
        assert known, f"the proxy dispatches on {constant!r}; docs/reference.md does not list that route"
    host, port = await app.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as http:
            for method, path in documented:
                url = f"http://{host}:{port}" + path.replace("{session_id}", "s1").replace("{name}", "nope")
                async with http.request(method, url, json={} if method != "GET" else None) as resp:
                    body = await resp.read()
                assert not (resp.status == 404 and b"unknown_route" in body), (
                    f"docs/reference.md lists {method} {path}; kvgate answers {body!r}"
                )
    finally:
        await app.close()


def _header_constants() -> set[str]:
    """`x-...` header names written as string or bytes literals in the product's code."""
    found: set[str] = set()
    for path in tracked_files("*.py"):
        if path.relative_to(REPO).parts[0] in ("tests", "bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
                value = node.value.decode() if isinstance(node.value, bytes) else node.value
                if re.fullmatch(r"(?i)x-[a-z0-9]+(-[a-z0-9]+)*", value):
                    found.add(value.lower())
    return found


def test_headers_are_documented():
    sections = doc_sections()
    documented = {
        first_code(r[0]) or "" for t in ("Request headers", "Response headers") for r in table_rows(sections[t])
    }
    custom = {h.lower() for h in documented if h.lower().startswith("x-")}
    assert_same(custom, _header_constants(), "Request and Response headers")
    settings = _settings_class()()
    assert {settings.session.header, settings.session.finish_header} <= custom


def test_admission_reasons_are_documented():
    from kvgate.gate.policies.vocabulary import AdmissionReason

    documented = {first_code(r[0]) for r in table_rows(doc_sections()["Admission reasons"])}
    assert_same(documented, {reason.value for reason in AdmissionReason}, "Admission reasons")


# ---------------------------------------------------------------- errors

# The calls that answer a client with an error code: callee -> (index of the status
# argument, index of the code argument); None: an error event inside a stream, no status.
ERROR_CALLS = {
    "RequestRejected": (0, 2),
    "_Refusal": (0, 2),
    "HeadRefusal": (0, 2),
    "send_error": (1, 3),
    "error_json": (0, 2),
}
STREAM_ERROR_CALLS = {"sse_error_event": 1}
STREAM = "stream"


def _constants(node: ast.AST | None) -> list:
    """A constant argument's value, or both branches of a conditional one; [] when computed
    (`exc.code`: the code of an error found elsewhere, passed on)."""
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _constants(node.body) + _constants(node.orelse)
    return []


def _argument(call: ast.Call, index: int, name: str) -> ast.AST | None:
    if index < len(call.args):
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == name), None)


def _emitted_error_codes() -> set[tuple[str, str]]:
    """(status, code) of every error the front door (proxy/, gate/, balancer/) can answer with:
    the error calls' constant codes (a callee's default code when the call gives none), and
    the `status`/`code` class attributes of every error class that is instantiated."""
    trees = [
        ast.parse(path.read_text()) for part in ("proxy", "gate", "balancer") for path in (REPO / part).rglob("*.py")
    ]
    default_codes: dict[str, str] = {}
    classes: dict[str, tuple[list[str], dict[str, object]]] = {}
    calls: list[ast.Call] = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                attrs = {}
                for stmt in node.body:
                    target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
                    if isinstance(target, ast.Name) and isinstance(getattr(stmt, "value", None), ast.Constant):
                        attrs[target.id] = stmt.value.value  # type: ignore[union-attr]
                    if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                        names = [a.arg for a in stmt.args.args]
                        names = names[len(names) - len(stmt.args.defaults) :]  # the defaults are the last ones
                        for arg, default in zip(names, stmt.args.defaults):
                            if arg == "code" and isinstance(default, ast.Constant):
                                default_codes[node.name] = default.value
                classes[node.name] = ([b.id for b in node.bases if isinstance(b, ast.Name)], attrs)
            elif isinstance(node, ast.Call):
                calls.append(node)
    emitted: set[tuple[str, str]] = set()
    instantiated = set()
    for call in calls:
        name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
        instantiated.add(name)
        if name in STREAM_ERROR_CALLS:
            emitted |= {(STREAM, code) for code in _constants(_argument(call, STREAM_ERROR_CALLS[name], "code"))}
        if name not in ERROR_CALLS:
            continue
        status_at, code_at = ERROR_CALLS[name]
        code_node = _argument(call, code_at, "code")
        found = _constants(code_node) if code_node is not None else [default_codes[name]]
        statuses = _constants(_argument(call, status_at, "status"))
        assert statuses or not found, f"{ast.unparse(call)}: a constant code with a computed status"
        emitted |= {(str(status), code) for status in statuses for code in found}

    def attribute(cls: str, attr: str) -> object:
        bases, attrs = classes[cls]
        if attr in attrs:
            return attrs[attr]
        return next((attribute(b, attr) for b in bases if b in classes), None)

    for cls in instantiated & set(classes):
        code, status = attribute(cls, "code"), attribute(cls, "status")
        if isinstance(code, str) and isinstance(status, int):
            emitted.add((str(status), code))
    return emitted


def test_error_codes_are_documented():
    """The Errors table lists exactly the (status, code) pairs the front door can answer with;
    a status cell may name several statuses, or say the code comes inside a stream."""
    documented = set()
    for row in table_rows(doc_sections()["Errors"]):
        statuses = [STREAM] if STREAM in row[0] else re.findall(r"\d{3}", row[0])
        documented |= {(status, code) for status in statuses for code in codes(row[1])}
    assert_same(documented, _emitted_error_codes(), "Errors")


# ---------------------------------------------------------------- probe API


async def _simulated_replica_answers() -> tuple[set[tuple[str, str]], dict[str, set[str]]]:
    """A live simulated replica: its /v1/kvgate routes and the fields of each answer (an
    `engines` entry's fields count as the answer's)."""
    from kvgate.simulator.replica_server import build_replica_app

    app = build_replica_app()
    routes = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.resource.canonical.startswith("/v1/kvgate/") and route.method != "HEAD"
    }
    server = TestServer(app)
    await server.start_server()
    fields: dict[str, set[str]] = {}
    try:
        async with aiohttp.ClientSession() as http:
            base = str(server.make_url(""))
            calls = {
                "kv": ("GET", "/v1/kvgate/kv", None),
                "prefix": ("POST", "/v1/kvgate/prefix", {"token_ids": list(range(40))}),
                "owner": ("POST", "/v1/kvgate/owner", {"gate_id": "g", "ttl_sec": 1}),
            }
            for name, (method, path, body) in calls.items():
                async with http.request(method, base + path, json=body) as resp:
                    answer = await resp.json()
                assert resp.status == 200, answer
                fields[name] = set(answer) | {k for entry in answer.get("engines", []) for k in entry}
    finally:
        await server.close()
    return routes, fields


def _wire_answer_fields() -> dict[str, set[str]]:
    """The fields of the typed answers in `kvgate.wire`, which both the vLLM plugin and the
    simulated replica build their answers with (`to_json()` writes every field)."""
    from kvgate.wire.owner_record import OwnerAnswer
    from kvgate.wire.probe_api import KvAnswer, PrefixAnswer

    return {
        name: {f.name for f in dataclasses.fields(cls)}
        for name, cls in (("kv", KvAnswer), ("prefix", PrefixAnswer), ("owner", OwnerAnswer))
    }


def _documented_fields(title: str) -> set[str]:
    return {first_code(r[0]) or "" for r in table_rows(doc_sections()[title])}


async def test_probe_api_is_documented():
    routes, simulated = await _simulated_replica_answers()
    typed = _wire_answer_fields()
    from kvgate.wire.kv_pins import RELEASE_PATH

    # The release route is the vLLM plugin's too (its retention connector, tests/vllm/test_pins_on_vllm.py).
    served = routes | {("POST", RELEASE_PATH)}
    assert_same(set(_documented_routes("Replica side: the probe API and the owner record")), served, "Replica side")
    prefix_rows = table_rows(doc_sections()["`POST /v1/kvgate/prefix`"])
    bodies = {re.match(r'`\{"(\w+)"', r[0]).group(1) for r in prefix_rows if r[0].startswith("`{")}  # type: ignore[union-attr]
    documented = {
        "kv": _documented_fields("`GET /v1/kvgate/kv`") | {"engine"},
        "prefix": {first_code(r[0]) or "" for r in prefix_rows if not r[0].startswith("`{")} | {"engine"},
        "owner": _documented_fields("`/v1/kvgate/owner`"),
    }
    for name, fields in documented.items():
        code = simulated[name] | typed[name]
        assert_same(fields, code, f"the probe API's {name} answer")
    from kvgate.wire.probe_api import QUERY_KINDS

    assert_same(bodies, set(QUERY_KINDS), "the prefix probe's bodies")


# ---------------------------------------------------------------- metrics


async def test_every_metric_family_is_documented():
    """The families a proxy's /metrics exposes (its registry, with every collector the app
    registers, the replicas' mirrored series too), counters under their exposed `_total` name."""
    from kvgate.proxy.app import create_app

    app = create_app(_settings_class()(), replicas=(), health_checks=False)
    try:
        code = {f.name + "_total" if f.type == "counter" else f.name for f in app.metrics.registry.collect()}
    finally:
        await app.close()
    documented = {first_code(r[0]) for r in table_rows(doc_sections()["Metrics"])}
    assert_same(documented, code, "Metrics")
