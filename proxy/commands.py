"""`kvgate serve` and `kvgate check-config` (docs/reference.md, Command line)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys

from kvgate.proxy.config import ConfigError, load_settings
from kvgate.proxy.server import SimulatedReplicas
from kvgate.wire.owner_record import OWNER_PATH
from kvgate.wire.probe_api import KV_PATH


def add_commands(subparsers, simulated_replicas: SimulatedReplicas | None = None) -> None:
    """Add serve and check-config. `simulated_replicas(count, host)` starts the replicas
    `kvgate serve` serves when none is configured (the command line passes the simulator's)."""
    serve = subparsers.add_parser(
        "serve",
        help="run the proxy",
        description="Run the kvgate proxy. With no `replicas` configured it starts `simulated_replicas` "
        "simulated vLLM replicas in-process and serves them.",
    )
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file (default: built-in defaults); KVGATE_<PATH> environment variables override it",
    )
    serve.add_argument("--host", help="listen address (overrides listen.host)")
    serve.add_argument("--port", type=int, help="listen port, 0 for a free one (overrides listen.port)")
    serve.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default INFO)"
    )
    serve.set_defaults(func=functools.partial(serve_command, simulated_replicas=simulated_replicas))

    check = subparsers.add_parser(
        "check-config",
        help="validate a config file",
        description="Validate a config file (with KVGATE_* environment overrides applied): exit 0 when "
        "valid, else exit 2 with one line per problem naming the key.",
    )
    check.add_argument("file", metavar="FILE", help="YAML config file")
    check.add_argument(
        "--contact-replicas",
        action="store_true",
        help="also ask every configured replica: is it a kvgate (a front door needs one, a "
        f"gate must not have one), does it serve the probe API (GET {KV_PATH}: a vLLM without "
        f"the kvgate plugin is a problem), and does another gate already own it (GET {OWNER_PATH})",
    )
    check.set_defaults(func=check_config_command)


def _settings_or_exit(path: str | None):
    try:
        return load_settings(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"kvgate: config: {problem}", file=sys.stderr)
        return None


def check_config_command(args: argparse.Namespace) -> int:
    settings = _settings_or_exit(args.file)
    if settings is None:
        return 2
    replicas = (
        f"{len(settings.replicas)} replicas"
        if settings.replicas
        else f"no replicas (serve starts {settings.simulated_replicas} simulated)"
    )
    if getattr(args, "contact_replicas", False):
        from kvgate.proxy.replica_check import contact_replicas

        problems, notes = contact_replicas(settings)
        for note in notes:
            print(f"kvgate: note: {note}")
        if problems:
            for problem in problems:
                print(f"kvgate: config: {problem}", file=sys.stderr)
            return 2
    print(
        f"{args.file}: ok ({replicas}, gate {settings.gate.mode}/{settings.gate.policy}, "
        f"balancer {settings.balancer.algorithm}, role {settings.role})"
    )
    return 0


def serve_command(args: argparse.Namespace, simulated_replicas: SimulatedReplicas | None = None) -> int:
    settings = _settings_or_exit(args.config)
    if settings is None:
        return 2
    listen = settings.listen
    if args.host is not None:
        listen = dataclasses.replace(listen, host=args.host)
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            print(f"kvgate: --port must be 0..65535, got {args.port}", file=sys.stderr)
            return 2
        listen = dataclasses.replace(listen, port=args.port)
    settings = dataclasses.replace(settings, listen=listen)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.log.access:  # bare logfmt lines, whatever --log-level says
        from kvgate.proxy.access_log import configure_access_log

        configure_access_log(sys.stderr)
    from kvgate.proxy.event_loop import run
    from kvgate.proxy.server import ListenError, NoReplicas, serve

    try:
        run(serve(settings, simulated_replicas=simulated_replicas))
    except KeyboardInterrupt:
        pass
    except ListenError as exc:
        print(f"kvgate: {exc.strerror}", file=sys.stderr)
        return 1
    except (OSError, NoReplicas) as exc:
        logging.getLogger("kvgate").error("cannot serve: %s", exc)
        return 1
    return 0
