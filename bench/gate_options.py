"""The gate settings a benchmark run may override on its command line (`kvgate bench
agentic`, `kvgate sim cluster`): each `GateSettings` field a flag of the same name."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

Options = dict[str, tuple[Callable[[str], Any], str]]  # option name -> (its type, its help)


def yes_no(value: str) -> bool:
    """A yes|no flag's value (argparse reports the error as the flag's)."""
    if value not in ("yes", "no"):
        raise argparse.ArgumentTypeError(f"expected yes or no, got {value!r}")
    return value == "yes"


GATE_OPTIONS: Options = {
    "high_watermark": (float, "KV usage at or above which the gate checks prefixes"),
    "hit_threshold": (float, "prefix hit ratio that admits a session under pressure"),
    "idle_grace_sec": (float, "how long a session keeps its window between turns"),
    "wait_poll_sec": (float, "re-evaluation interval of a waiting turn"),
    "headroom_blocks": (int, "working_set policy: blocks kept free"),
    "max_wait_sec": (float, "0: wait as long as needed; >0: then 503"),
    "quiet_factor": (float, "an idle window ends after this many times its session's usual gap"),
    "quiet_floor_sec": (float, "... but never sooner than this (idle_grace_sec is the ceiling)"),
    "late_floor_sec": (float, "a session is late (its pin ends) once idle its usual gap, never sooner than this"),
    "wait_cap_factor": (float, "working_set: a held turn goes in once it waited this x its session's turn time"),
    "held_priority": (int, "working_set: forward a held turn at this vLLM priority (replicas schedule by priority)"),
    "work_conserving": (
        yes_no,
        "yes|no: working_set policy admits a held turn when holding costs more than the re-prefill it causes",
    ),
    "place_sessions": (
        yes_no,
        "yes|no: a new session goes to the replica whose gate books the fewest sessions (no: rendezvous hashing)",
    ),
    "relocate_held": (
        yes_no,
        "yes|no: a held turn moves to a replica with nothing in flight or waiting once it waited its re-prefill",
    ),
}


def add_option_flags(group: Any, options: Options, prefix: str) -> None:
    """One flag per option (`--max-num-seqs N`), its value at `prefix` + its name in the
    parsed arguments (None when not given). `group`: a parser or an argument group."""
    for name, (kind, text) in options.items():
        group.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=None,
            dest=prefix + name,
            help=text,
            metavar="N" if kind is int else "{yes,no}" if kind is yes_no else "X",
        )


def add_gate_options(parser: argparse.ArgumentParser, title: str) -> None:
    """One flag per `GATE_OPTIONS` entry (`--wait-cap-factor X`), in a group titled `title`."""
    add_option_flags(parser.add_argument_group(title), GATE_OPTIONS, "g_")


def option_values(args: argparse.Namespace, options: Options, prefix: str) -> dict[str, Any]:
    """The options `add_option_flags(group, options, prefix)` added that were given, by name."""
    return {name: getattr(args, prefix + name) for name in options if getattr(args, prefix + name) is not None}


def gate_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The gate settings the command line sets (`add_gate_options`' flags that were given)."""
    return option_values(args, GATE_OPTIONS, "g_")
