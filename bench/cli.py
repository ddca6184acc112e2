"""`kvgate bench ...`: the benchmark subcommands.

Each benchmark module has `add_command(bench_subparsers)` (`add_parser` for agentic), which adds its parser and
sets `func`. To add a benchmark, import its module here and add one line to
`add_commands`.
"""

from __future__ import annotations

from kvgate.bench import gate_load, overhead, probe_latency, results_page, scale_out_load
from kvgate.bench.agentic import cli as agentic_cli


def add_commands(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks", description="Benchmarks of kvgate. Each prints its numbers; none asserts them."
    )
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    overhead.add_command(benchmarks)
    gate_load.add_command(benchmarks)
    probe_latency.add_command(benchmarks)
    scale_out_load.add_command(benchmarks)
    agentic_cli.add_parser(benchmarks)
    results_page.add_command(benchmarks)
