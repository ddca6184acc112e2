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


def build_parser() -> argparse.ArgumentParser:
    from kvgate.bench import cli as bench_cli
    from kvgate.bench.cluster.cli import add_cluster_command
    from kvgate.cli import top
    from kvgate.proxy import commands as proxy_commands
    from kvgate.simulator import cli as simulator_cli
    from kvgate.simulator.replica_server import start_simulated_replicas

    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="Session-aware admission proxy for vLLM: pins each agent session to one "
        "replica and, under KV-cache pressure, holds back turns whose prefix is no longer "
        "resident, so replicas keep serving sessions that reuse their prefix cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    proxy_commands.add_commands(sub, start_simulated_replicas)
    simulator_cli.add_commands(sub, sim_experiments=[add_cluster_command])
    bench_cli.add_commands(sub)
    top.add_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)
