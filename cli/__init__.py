"""The `kvgate` command line (docs/reference.md, Command line): the one place that assembles the parts.

Each part registers its own subcommands, so this module only assembles the parser:
`proxy.commands` adds serve and check-config (handed the simulator's replicas, which
`kvgate serve` starts when no replica is configured), `simulator.cli` adds replica and
sim, `bench.cli` adds bench, and `cli.top` adds top (a client of a running kvgate's
admin API). Nothing imports this package: the parts stay independent of one another,
and only the command line depends on all of them (tests/test_layering.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def _proxy_commands(sub) -> None:
    from kvgate.proxy import commands as proxy_commands
    from kvgate.simulator.replica_server import start_simulated_replicas

    proxy_commands.add_commands(sub, start_simulated_replicas)


def _replica_command(sub) -> None:
    from kvgate.simulator.cli import add_replica_command

    add_replica_command(sub)


def _sim_command(sub) -> None:
    from kvgate.bench.cluster.cli import add_cluster_command
    from kvgate.simulator.experiment_cli import add_sim_command

    add_sim_command(sub, [add_cluster_command])


def _bench_commands(sub) -> None:
    from kvgate.bench import cli as bench_cli

    bench_cli.add_commands(sub)


def _top_command(sub) -> None:
    from kvgate.cli import top

    top.add_command(sub)


# Each part's registration and the commands it adds, in the order `kvgate --help` lists them
# (tests/test_command_line.py holds the names to what each adds). A command's process imports its
# own part alone: `kvgate replica`, started many times over by the benchmarks and tests,
# starts without importing the proxy and the benchmarks.
PARTS: tuple[tuple[tuple[str, ...], Callable[[argparse._SubParsersAction], None]], ...] = (
    (("serve", "check-config"), _proxy_commands),
    (("replica",), _replica_command),
    (("sim",), _sim_command),
    (("bench",), _bench_commands),
    (("top",), _top_command),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or, when `command` names one, of its part's commands alone."""
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="Session-aware admission proxy for vLLM: pins each agent session to one "
        "replica and, under KV-cache pressure, holds back turns whose prefix is no longer "
        "resident, so replicas keep serving sessions that reuse their prefix cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    own = [register for names, register in PARTS if command in names]
    for register in own or [register for _, register in PARTS]:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
