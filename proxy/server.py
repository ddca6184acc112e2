"""`kvgate serve`: the process around the app (replicas, event loop, signals).

The admission gate is the app's default controller (`proxy.app.create_app`); its
`gate.mode` setting turns it to shadow or off.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from kvgate.balancer.settings import ReplicaSettings
from kvgate.proxy.app import create_app
from kvgate.proxy.metrics import KvgateMetrics
from kvgate.proxy.settings import Settings

log = logging.getLogger("kvgate")


class RunningReplica(Protocol):
    """A replica started for this process: its name and URL, and how to stop it."""

    name: str
    url: str

    async def stop(self) -> None: ...


# (count, host) -> that many replicas started on free ports of host
SimulatedReplicas = Callable[..., Awaitable[Sequence[RunningReplica]]]


class NoReplicas(Exception):
    """No replica is configured and no simulated replicas can be started."""


async def start_replicas(
    settings: Settings, simulated_replicas: SimulatedReplicas | None = None
) -> tuple[tuple[ReplicaSettings, ...], Sequence[RunningReplica]]:
    """The replicas to serve, and the simulated ones started for them (to stop later)."""
    if settings.replicas:
        log.info(
            "serving %d configured replicas: %s",
            len(settings.replicas),
            ", ".join(f"{r.name}={r.url}" for r in settings.replicas),
        )
        return settings.replicas, []
    if simulated_replicas is None:
        raise NoReplicas("no replicas configured: set `replicas` in the config")
    log.info(
        "no replicas configured: starting %d simulated replicas in-process "
        "(simulator.replica_server); set `replicas` in the config to serve vLLM",
        settings.simulated_replicas,
    )
    sims = await simulated_replicas(
        settings.simulated_replicas, host="127.0.0.1", replica_api_key=settings.upstream.replica_api_key
    )
    log.info("simulated replicas up: %s", ", ".join(f"{s.name}={s.url}" for s in sims))
    return tuple(ReplicaSettings(s.name, s.url) for s in sims), sims


class ListenError(OSError):
    """The listen address cannot be bound; the message says what to do."""


def check_listen_address(host: str, port: int) -> None:
    """Bind `host:port` once and let go, before anything else starts: a busy port or an
    address this host does not have is reported at once, not after the simulated replicas
    started. (The app binds again right after; SO_REUSEADDR, as there.)"""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in infos:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        fix = (
            "stop what listens there, or choose another port (--port, listen.port or KVGATE_LISTEN__PORT)"
            if exc.errno == errno.EADDRINUSE
            else "choose an address of this host (--host, listen.host or KVGATE_LISTEN__HOST; 0.0.0.0 for all)"
        )
        raise ListenError(exc.errno, f"cannot listen on {host}:{port}: {reason}; {fix}") from None


async def serve(
    settings: Settings, stop: asyncio.Event | None = None, simulated_replicas: SimulatedReplicas | None = None
) -> None:
    """Run the proxy until `stop` is set (by default: SIGINT or SIGTERM). With no replica
    configured it serves `simulated_replicas(settings.simulated_replicas, host=...)`."""
    check_listen_address(settings.listen.host, settings.listen.port)
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    replicas, sims = await start_replicas(settings, simulated_replicas)
    app = None
    try:
        metrics = KvgateMetrics()
        app = create_app(settings, metrics=metrics, replicas=replicas)
        host, port = await app.start()
        log.info("role %s, gate %s/%s", settings.role, settings.gate.mode, settings.gate.policy)
        log.info("listening on http://%s:%d (OpenAI base URL http://%s:%d/v1)", host, port, host, port)
        await stop.wait()
        log.info("shutting down")
    finally:
        if app is not None:
            await app.close()
        await asyncio.gather(*(s.stop() for s in sims), return_exceptions=True)
