"""Loading the configuration: YAML file + `KVGATE_*` environment overrides -> Settings.

The schema is `proxy.settings.Settings` (frozen dataclasses, composing the parts' own:
`gate.settings`, `balancer.settings`); this module walks it, so a
field added there is loaded and type-checked here with no further change. Ranges and
choices that types cannot express live in RULES, keyed by dotted path; the choices
come from the registries that use them (`gate.policies.registry.POLICIES`, `gate.gate.MODES`,
`balancer.balancer.ALGORITHMS`, `proxy.topology.ROLES`), so a policy, mode or
algorithm added there is accepted here.

Environment overrides: `KVGATE_<PATH>` with `__` between levels
(`KVGATE_GATE__HIGH_WATERMARK=0.9`); the value is read as a YAML scalar or flow
collection (`true`, `0.9`, `[a, b]`, `[{name: r0, url: ...}]`). `KVGATE_` is kvgate's
namespace: a variable there that names no setting is an error naming it (with the
nearest setting's variable: `KVGATE_GATE_POLICY` -> `KVGATE_GATE__POLICY`), except the
project's other variables, `OTHER_VARIABLES` (the plugin's and the test harnesses'), and
the service-link variables Kubernetes writes for a Service named `kvgate...`
(`proxy.service_links`: `KVGATE_SERVICE_HOST=10.0.0.11`, `KVGATE_PORT=tcp://...`).

Numbers are read as users write them: `1.0e9` and `1e9` are numbers (YAML 1.2), not
the strings YAML 1.1 makes of them, and an integer setting takes a whole number written
as a float (`1e9`, `2.0`).

Every problem is collected, not just the first: `ConfigError.problems` holds one
line per problem, each naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvgate.balancer.balancer import ALGORITHMS
from kvgate.balancer.replica_fields import is_token, replica_name_problem, replica_url_key, replica_url_problem
from kvgate.gate.gate import MODES
from kvgate.gate.ownership import MAX_CONFIGURED_GATE_ID_CHARS
from kvgate.gate.pins import PIN_MODES
from kvgate.gate.policies.registry import policy_name_problem
from kvgate.proxy.errors import clipped as _clipped
from kvgate.proxy.http_fields import field_value_problem
from kvgate.proxy.service_links import is_service_link
from kvgate.proxy.settings import Settings
from kvgate.proxy.topology import ROLES, role_problems

ENV_PREFIX = "KVGATE_"
# `KVGATE_*` variables that are not settings: read by the vLLM plugin, the test harnesses
# and CI (docs/reference.md, "Other environment variables"). Every other one is an error.
OTHER_VARIABLES = frozenset(
    {
        "KVGATE_PROBE_TIMEOUT_SEC",
        "KVGATE_CPU_LOAD_GBPS",
        "KVGATE_STEP_LOG",
        "KVGATE_REPLICA_API_KEY",
        "KVGATE_REPLICA_API_KEY_FILE",
        "KVGATE_VLLM_VENV",
        "KVGATE_CACHE_DIR",
        "KVGATE_E2E_ROUNDS",
        "KVGATE_E2E_POLICY",
        "KVGATE_CI_FRESH",
        "KVGATE_PROMETHEUS",
        "KVGATE_PROMTOOL",
        "KVGATE_CHROMIUM",
        "KVGATE_WRITE_SCREENSHOT",
    }
)


MAX_YAML_DEPTH = 32  # nested collections; kvgate's deepest setting is 3 levels down


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading YAML 1.2 floats: `1.0e9`, `1e9`, `1E-3` are numbers
    (YAML 1.1 wants `1.0e+9` and reads the others as strings, which nobody guesses).

    Hostile files end in one problem line, never in a traceback or a long wait: aliases
    (`*name`, which let 400 bytes expand into gigabytes) and collections nested deeper
    than MAX_YAML_DEPTH are refused while composing, and a key given twice in one
    mapping is a problem (PyYAML keeps the last one silently)."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not accepted; write the value out", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {_clipped(repr(key))} is given twice in one mapping", key_node.start_mark
                    )
                if isinstance(key, typing.Hashable):
                    seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_load(text: str):
    """`text` parsed as kvgate reads config YAML (safe, YAML 1.2 numbers)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: no Python objects


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _in_range(
    lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> Callable[[Any], str | None]:
    def check(value) -> str | None:
        if lo is not None and (value <= lo if lo_open else value < lo):
            return f"must be {'>' if lo_open else '>='} {lo}"
        if hi is not None and (value >= hi if hi_open else value > hi):
            return f"must be {'<' if hi_open else '<='} {hi}"
        return None

    return check


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(value) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def _non_empty(value) -> str | None:
    return "must not be empty" if not value else None


def _header_name(value) -> str | None:
    return None if is_token(value) else "must be a header name (letters, digits, - and _)"


def _gate_id_problem(value: str) -> str | None:
    """Room for the instance suffix the owner claims add (gate.ownership.instance_id)."""
    if len(value) > MAX_CONFIGURED_GATE_ID_CHARS:
        return f"must be 1-{MAX_CONFIGURED_GATE_ID_CHARS} characters"
    return _non_empty(value)


def _secret_value_problem(value: str) -> str | None:
    return _non_empty(value) or field_value_problem(value)


# Settings whose values are secrets: a problem with one names the key and never shows the
# value (`_shown`), so a config error in a log or a terminal leaks nothing.
SECRET_KEYS = frozenset({"upstream.api_key", "upstream.replica_api_key", "admin.token", "auth.api_keys"})


def is_secret(path: str) -> bool:
    """Whether the dotted `path` (list items as `[i]`) holds a secret."""
    key = _rule_key(path).replace("[]", "")
    return key in SECRET_KEYS


_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def _redacted(text: str) -> str:
    """`text` with the user info of any URL in it (`user:password@`) replaced."""
    return _USERINFO.sub("<user info>@", text)


def _shown(path: str, value) -> str:
    """`value` as a problem line may show it: a secret's only as its kind and length, a
    URL's without its user info, a long one cut short."""
    if is_secret(path):
        size = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        return f"<secret, {size}>"
    return _clipped(_redacted(repr(value)))


RULES: dict[str, Callable[[Any], str | None]] = {
    "listen.host": _non_empty,
    "listen.port": _in_range(0, 65535),
    "replicas[].name": replica_name_problem,
    "replicas[].url": replica_url_problem,
    "replicas[].weight": _in_range(0, lo_open=True),
    "simulated_replicas": _in_range(1, 64),
    "session.header": _non_empty,
    "session.client_headers[]": _header_name,
    "session.body_fields[]": _non_empty,
    "session.finish_header": _non_empty,
    "balancer.algorithm": _one_of(*ALGORITHMS),
    "balancer.load_factor": _in_range(1),
    "balancer.health.interval_sec": _in_range(0, lo_open=True),
    "balancer.health.timeout_sec": _in_range(0, lo_open=True),
    "balancer.health.unhealthy_after": _in_range(1),
    "balancer.health.healthy_after": _in_range(1),
    "gate.mode": _one_of(*MODES),
    "gate.policy": policy_name_problem,
    "gate.high_watermark": _in_range(0, 1, lo_open=True),
    "gate.hit_threshold": _in_range(0, 1),
    "gate.idle_grace_sec": _in_range(0),
    "gate.wait_poll_sec": _in_range(0, lo_open=True),
    "gate.max_wait_sec": _in_range(0),
    "gate.headroom_blocks": _in_range(0),
    "gate.probe.timeout_sec": _in_range(0, lo_open=True),
    "gate.probe.usage_max_age_ms": _in_range(0),
    "gate.quiet_factor": _in_range(1),
    "gate.quiet_floor_sec": _in_range(0),
    "gate.late_floor_sec": _in_range(0),
    "gate.wait_cap_factor": _in_range(0),
    "gate.held_priority": _in_range(0),
    "gate.pins": _one_of(*PIN_MODES),
    "upstream.connect_timeout_sec": _in_range(0, lo_open=True),
    "upstream.read_timeout_sec": _in_range(0, lo_open=True),
    "limits.max_body_bytes": _in_range(1),
    "limits.max_head_bytes": _in_range(1024),
    "limits.max_headers": _in_range(1),
    "limits.header_timeout_sec": _in_range(0, lo_open=True),
    "limits.body_timeout_sec": _in_range(0, lo_open=True),
    "limits.body_deadline_sec": _in_range(0, lo_open=True),
    "limits.keepalive_timeout_sec": _in_range(0, lo_open=True),
    "limits.write_timeout_sec": _in_range(0, lo_open=True),
    "limits.max_connections": _in_range(1),
    "limits.max_buffered_response_bytes": _in_range(0),
    "upstream.api_key": field_value_problem,
    "upstream.replica_api_key": field_value_problem,
    "upstream.credential_hosts[]": _non_empty,
    "auth.api_keys[]": _secret_value_problem,
    "role": _one_of(*ROLES),
    "ownership.ttl_sec": _in_range(0, 3600),
    "ownership.gate_id": _gate_id_problem,
}


# YAML 1.1 reads a bare `off` as the boolean false; the documented value is the word `off`.
YAML_BOOL_WORDS: dict[str, dict[bool, str]] = {"gate.mode": {False: "off"}}


# ---- reading the sources ------------------------------------------------------------


def read_yaml(path: str | Path) -> dict:
    """The YAML file as a mapping (an empty file is {}); ConfigError (one line) if it cannot be
    read, is not UTF-8, is not YAML kvgate accepts (`_Loader`) or holds a number too long."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"config file {path}: cannot read it ({exc.strerror or exc})"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8"]) from None
    try:
        data = yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"config file {path}: not valid YAML ({_yaml_problem(exc)})"]) from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.int_info)
        raise ConfigError([f"config file {path}: a value cannot be read ({_clipped(str(exc))})"]) from None
    except RecursionError:
        raise ConfigError([f"config file {path}: nested too deeply"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"config file {path}: the top level must be a mapping of keys, got {type(data).__name__}"])
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without the quoted snippet of the file PyYAML adds (the
    line could hold a secret)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)


def apply_env_overrides(data: dict, environ: Mapping[str, str]) -> tuple[dict, list[str], dict[str, str]]:
    """`data` with the KVGATE_* overrides applied, the problems found in them, and
    which variable set each dotted path."""
    origins: dict[str, str] = {}
    top = {f.name for f in dataclasses.fields(Settings)}
    problems: list[str] = []
    merged = _deep_copy(data)
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX) :].split("__")]
        if parts[0] not in top:
            if var not in OTHER_VARIABLES and not is_service_link(var, environ[var]):
                problems.append(_unknown_variable(var))
            continue
        value = _env_value(environ[var], _leaf_type(parts))
        node = merged
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"{var}: {'.'.join(parts[: i + 1])} is not a section, cannot set {'.'.join(parts)}")
                break
            node = child
        else:
            node[parts[-1]] = value
            origins[".".join(parts)] = var
    return merged, problems, origins


def setting_variables(cls=Settings, prefix: str = ENV_PREFIX) -> list[str]:
    """The variable of every setting: `KVGATE_GATE__POLICY`, ... (sections and leaves)."""
    names = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name.upper()
        names.append(name)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            names += setting_variables(tp, name + "__")
    return names


def _unknown_variable(var: str) -> str:
    known = setting_variables()
    # compare with the level separators spelled alike, so `_` for `__` is the nearest miss
    spelled = {name.replace("__", "_"): name for name in known}
    close = difflib.get_close_matches(var.replace("__", "_"), list(spelled), n=1, cutoff=0.8)
    hint = f" (did you mean {spelled[close[0]]}?)" if close else ""
    return (
        f"{var}: not a kvgate setting{hint}. Settings are KVGATE_<PATH> with __ between levels "
        "(KVGATE_GATE__POLICY); unset the variable if it is not meant for kvgate"
    )


def _leaf_type(parts: list[str]):
    """The annotation of the setting at `parts`, or None when the path is unknown."""
    cls = Settings
    tp = None
    for part in parts:
        if not dataclasses.is_dataclass(cls):
            return None
        tp = typing.get_type_hints(cls).get(part)
        if tp is None:
            return None
        cls = tp
    return tp


def _env_value(text: str, tp):
    """An environment value: raw text for string settings, else read as YAML."""
    stripped = text.strip()
    if stripped.lower() in ("", "null", "~"):
        return None
    if tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)):
        return text
    try:
        return yaml_load(text)
    except (yaml.YAMLError, ValueError, RecursionError):
        return text  # reported by validation as a wrong type, naming the key


def _deep_copy(data):
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


# ---- building and checking ---------------------------------------------------------


def _type_name(tp) -> str:
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        return "list"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(tp, str(tp))


def _convert(value, tp, path: str, problems: list[str]):
    """`value` checked against annotation `tp`; problems appended, _INVALID on failure."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            sub: list[str] = []
            out = _convert(value, arg, path, sub)
            if not sub:
                return out
        problems.append(f"{path}: must be {_type_name(tp)}, got {_describe(value, path)}")
        return _INVALID
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: must be a mapping of keys, got {_describe(value, path)}")
            return _INVALID
        return _build(tp, value, path + ".", problems)
    if origin in (tuple, list):
        (item_tp, *_rest) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{path}: must be a list, got {_describe(value, path)}")
            return _INVALID
        items = [_convert(v, item_tp, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        rule = RULES.get(_rule_key(path) + "[]")
        for i, item in enumerate(items):
            if rule is not None and item is not _INVALID:
                msg = rule(item)
                if msg:
                    problems.append(f"{path}[{i}]: {msg}, got {_shown(f'{path}[{i}]', item)}")
        return tuple(items)
    if tp is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # `1e9`, `2.0`: a whole number written as a float
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(tp)
    if ok is None:
        raise TypeError(f"proxy.config cannot check annotation {tp!r} of {path}; extend _convert")
    if not ok(value):
        problems.append(f"{path}: must be {_type_name(tp)}, got {_describe(value, path)}")
        return _INVALID
    if tp is float and not math.isfinite(value):
        problems.append(f"{path}: must be a finite number, got {value}")  # nan passes every range check
        return _INVALID
    return float(value) if tp is float else value


def _describe(value, path: str = "") -> str:
    if value is None:
        return "null"
    if is_secret(path):
        return _shown(path, value)
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )
    return f"{kind} {_clipped(_redacted(repr(value)), 40)}"


def _rule_key(path: str) -> str:
    """`replicas[2].url` -> `replicas[].url`."""
    out, depth = [], 0
    for ch in path:
        if ch == "[":
            depth += 1
            out.append("[]")
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


class _Invalid:
    pass


_INVALID = _Invalid()


def _build(cls, data: dict, prefix: str, problems: list[str]):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.8)
            meant = f" (did you mean {prefix}{close[0]}?)" if close else ""
            problems.append(f"{prefix}{_clipped(str(key))}: unknown key{meant}; known keys here: {', '.join(fields)}")
    kwargs = {}
    missing = False
    problems_before = len(problems)
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"{prefix}{name}: required key is missing")
                missing = True
            continue
        path = prefix + name
        raw = data[name]
        if isinstance(raw, bool) and path in YAML_BOOL_WORDS:
            raw = YAML_BOOL_WORDS[path].get(raw, raw)
        value = _convert(raw, hints[name], path, problems)
        if value is _INVALID:
            continue
        rule = RULES.get(_rule_key(path))
        if rule is not None and value is not None:
            msg = rule(value)
            if msg:
                problems.append(f"{path}: {msg}, got {_shown(path, value)}")
                continue
        kwargs[name] = value
    if missing or len(problems) > problems_before:
        return _INVALID
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        problems.append(f"{prefix.rstrip('.') or 'config'}: {exc}")
        return _INVALID


def settings_from_dict(data: dict) -> Settings:
    """A validated Settings, or ConfigError listing every problem."""
    problems: list[str] = []
    settings = _build(Settings, data, "", problems)
    problems.extend(duplicate_replica_problems(data.get("replicas")))
    if not problems and isinstance(settings, Settings):
        problems.extend(role_problems(settings))
    if problems:
        raise ConfigError(problems)
    return settings


def duplicate_replica_problems(replicas: object) -> list[str]:
    """Replica names and URLs listed more than once, read from the raw `replicas` list so
    they are reported beside every other problem (a URL twice: one server, two replicas,
    its cache counted twice)."""
    if not isinstance(replicas, list):
        return []
    seen: dict[str, dict[str, list[str]]] = {"name": {}, "url": {}}
    for i, item in enumerate(replicas):
        if not isinstance(item, dict):
            continue
        name, url = item.get("name"), item.get("url")
        if isinstance(name, str) and name:
            seen["name"].setdefault(name, []).append(f"replicas[{i}]")
        if isinstance(url, str) and replica_url_problem(url) is None:
            seen["url"].setdefault(replica_url_key(url), []).append(f"replicas[{i}] ({url})")
    problems = []
    for name, where in seen["name"].items():
        if len(where) > 1:
            problems.append(
                f"replicas: name {_clipped(repr(name))} is used more than once ({', '.join(where)}); "
                "names must be unique"
            )
    for where in seen["url"].values():
        if len(where) > 1:
            problems.append(f"replicas: one server is listed more than once: {', '.join(where)}; list each server once")
    return problems


def _with_origin(problem: str, origins: dict[str, str]) -> str:
    key = _rule_key(problem.split(":", 1)[0]).replace("[]", "")
    for path, var in origins.items():
        if key == path or key.startswith(path + "."):
            return f"{problem} (set by {var})"
    return problem


def load_settings(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """The configuration of `path` (None: defaults only) with environment overrides applied
    and the secret files (`*_file` keys) read into the keys they stand for."""
    data = read_yaml(path) if path is not None else {}
    merged, env_problems, origins = apply_env_overrides(data, os.environ if environ is None else environ)
    try:
        settings = settings_from_dict(merged)
    except ConfigError as exc:
        raise ConfigError(env_problems + [_with_origin(p, origins) for p in exc.problems]) from None
    if env_problems:
        raise ConfigError(env_problems)
    return read_secret_files(settings)


def _secret_lines(key: str, path: str, problems: list[str]) -> list[str]:
    """The non-blank lines of a secret file (lines starting with # skipped); a problem naming
    `key` when it cannot be read, is empty, or holds a line that cannot be a header value."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{key}: cannot read {path} ({getattr(exc, 'strerror', None) or exc})")
        return []
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        problems.append(f"{key}: {path} holds no key (one key per line)")
    elif any(field_value_problem(line) for line in lines):
        problems.append(f"{key}: {path} holds a line that is not printable ASCII; one key per line")
        return []
    return lines


def read_secret_files(settings: Settings) -> Settings:
    """`settings` with `upstream.api_key_file`, `upstream.replica_api_key_file` and
    `auth.api_keys_file` read (a key given both inline and as a file is a problem)."""
    problems: list[str] = []
    upstream, auth = settings.upstream, settings.auth
    keys: dict[str, str] = {}
    for name in ("api_key", "replica_api_key"):
        file = getattr(upstream, name + "_file")
        if file is None:
            continue
        if getattr(upstream, name) is not None:
            problems.append(f"upstream.{name}_file: upstream.{name} is set too; give the key one way")
            continue
        lines = _secret_lines(f"upstream.{name}_file", file, problems)
        if len(lines) > 1:
            problems.append(f"upstream.{name}_file: {file} holds {len(lines)} keys; give exactly one")
        elif lines:
            keys[name] = lines[0]
    api_keys = auth.api_keys
    if auth.api_keys_file is not None:
        api_keys = api_keys + tuple(_secret_lines("auth.api_keys_file", auth.api_keys_file, problems))
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(
        settings,
        upstream=dataclasses.replace(
            upstream,
            api_key=keys.get("api_key", upstream.api_key),
            replica_api_key=keys.get("replica_api_key", upstream.replica_api_key),
        ),
        auth=dataclasses.replace(auth, api_keys=api_keys),
    )
