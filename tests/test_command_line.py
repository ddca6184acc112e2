"""The `kvgate` command line: each command's part registers it, and a command's process
imports its own part alone (cli/__init__.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvgate.cli import PARTS, build_parser


def commands(parser: argparse.ArgumentParser) -> list[str]:
    (subcommands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(subcommands.choices)


def test_each_part_adds_the_commands_named_for_it():
    assert commands(build_parser()) == [name for names, _ in PARTS for name in names]
    for names, _ in PARTS:
        for name in names:
            assert commands(build_parser(name)) == list(names)
    assert commands(build_parser("no-such-command")) == commands(build_parser())  # argparse names the choices


def test_a_replica_process_imports_neither_the_proxy_nor_the_benchmarks():
    """`kvgate replica`, which benchmarks and tests start many times over, starts on the
    simulator alone."""
    script = (
        "import json, sys; from kvgate.cli import build_parser; "
        "args = build_parser('replica').parse_args(['replica', '--port', '0']); "
        "import kvgate.simulator.replica_server; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kvgate.'))))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    modules = json.loads(out.stdout)
    assert "kvgate.simulator.replica_server" in modules
    for part in ("kvgate.proxy", "kvgate.bench", "kvgate.gate", "kvgate.balancer"):
        assert not [m for m in modules if m == part or m.startswith(part + ".")], part
